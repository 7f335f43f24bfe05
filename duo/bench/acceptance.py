"""Per-token acceptance of duo's two sampled verification modes, measured on a real draft/target pair.

We sample a text from the TARGET at temperature T, decoding the target and the draft along the same
tokens, so that at every position t we hold both models' logits. With p = distribution(target, params),
q_res = the draft's distribution further capped to its top 10 (what a RESIDUAL session drafts from,
duo.draft.drafter.Drafter.draft_params) and q_full = the draft's distribution uncapped (what a COUPLED session
drafts from), the per-position acceptance probabilities are:

  residual    a = sum_i min(p_i, q_res_i)      exact (Leviathan et al. 2023: accept x ~ q w.p. min(1, p/q));
              sum_i min(p_i, q_full_i) is also reported: the maximal coupling, the most ANY scheme whose
              draft samples from q_full can accept (coupled included); capping may beat it (it moves q's
              mass onto the top tokens, where p's is).
  coupled     a = P(argmax_i p_i/E_i == argmax_i q_i/E_i), E_i = -ln u(seed, t, i) i.i.d. Exp(1).
              Exact: both races pick i iff E_j > E_i max(p_j/p_i, q_j/q_i) for all j != i; given E_i = e
              that has probability exp(-e S_i), S_i = sum_{j != i} max(.), and E[exp(-E S_i)] = 1/(1 + S_i), so
                  a = sum_i 1 / sum_j max(p_j/p_i, q_j/q_i)      (each term <= min(p_i, q_i)),
              summed over the whole vocabulary in O(n log n) (see coupled_exact). Cross-check: Monte Carlo
              over --noise-draws seeds per position with duo's own noise (duo.sampling.noise.uniforms, the race
              of coupled_sample), with its standard error over the noise (assuming the hash is ideal noise).
  argmax      a = p(argmax q): the draft proposes its argmax, the target samples (llama-server's default).

Means are over positions; se_positions is the standard error across positions (text variation).
Example: .venv/bin/python -m duo.bench.acceptance --temperatures 0.7 1.0 --positions 120 --noise-draws 400
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from duo.bench.cluster import ROOT
from duo.bench.machine import cpu_model
from duo.llama.model import Model
from duo.models import hub
from duo.sampling.coupled import coupled_sample
from duo.sampling.distributions import SparseDist, distribution, sample
from duo.sampling.noise import uniforms
from duo.sampling.params import SamplingParams

PROMPTS = ("Write a snake game in Python.", "Write a quicksort in C.",
           "Explain Python decorators with an example.")
TOP_K_CAP = 10  # duo-draft's --top-k-cap default


def dense(dist: SparseDist, n_vocab: int) -> np.ndarray:
    out = np.zeros(n_vocab)
    out[dist.ids] = dist.probs
    return out


def coupled_exact(p: np.ndarray, q: np.ndarray) -> float:
    """sum_i 1 / sum_j max(p_j/p_i, q_j/q_i) over the common support, in O(n log n) rather than O(n^2).

    max(p_j/p_i, q_j/q_i) is p_j/p_i exactly when r_j = p_j/q_j >= t_i = p_i/q_i (ties: both equal),
    so with j sorted by r the inner sum is A(t_i)/p_i + B(t_i)/q_i, A = the p-mass of r >= t (a
    suffix sum) and B = the q-mass of r < t (a prefix sum): one sort, then a binary search per i.
    """
    union = (p > 0) | (q > 0)  # j outside both supports adds max(0, 0) = 0
    pu, qu = p[union], q[union]
    with np.errstate(divide="ignore"):
        r = pu / qu  # q_j = 0: inf, always on p's side; p_j = 0: 0, always on q's side
    order = np.argsort(r, kind="stable")
    ranked, p_sorted, q_sorted = r[order], pu[order], qu[order]
    suffix_p = np.append(np.cumsum(p_sorted[::-1])[::-1], 0.0)  # suffix_p[k] = sum p_sorted[k:]
    prefix_q = np.insert(np.cumsum(q_sorted), 0, 0.0)  # prefix_q[k] = sum q_sorted[:k]
    both = (p > 0) & (q > 0)  # i outside either support never wins both races
    pi, qi = p[both], q[both]
    k = np.searchsorted(ranked, pi / qi, side="left")  # first j with r_j >= t_i (i itself included)
    return float((1.0 / (suffix_p[k] / pi + prefix_q[k] / qi)).sum())


def coupled_monte_carlo(p: SparseDist, q: SparseDist, position: int, draws: int) -> float:
    """Share of seeds whose coupled samples from p and q agree, at a fixed position."""
    same_support = np.array_equal(p.ids, q.ids)  # then one hash + log per token serves both races
    agree = 0
    for seed in range(draws):
        if same_support:
            e = -np.log(uniforms(seed, position, p.ids))  # exactly coupled_ranking's race
            tp, tq = int(p.ids[np.argmax(p.probs / e)]), int(q.ids[np.argmax(q.probs / e)])
            if seed == 0:  # guard the shortcut against duo's own function
                assert (tp, tq) == (coupled_sample(p, seed, position), coupled_sample(q, seed, position))
        else:
            tp, tq = coupled_sample(p, seed, position), coupled_sample(q, seed, position)
        agree += tp == tq
    return agree / draws


def measure_position(t_logits: np.ndarray, d_logits: np.ndarray, params: SamplingParams, position: int,
                     draws: int) -> tuple[dict[str, float], SparseDist]:
    p = distribution(t_logits, params)
    q_res = distribution(d_logits, replace(params, top_k=min(params.top_k or TOP_K_CAP, TOP_K_CAP)))
    q_full = distribution(d_logits, params)
    n = t_logits.size
    pd, qf = dense(p, n), dense(q_full, n)
    row = {"residual": float(np.minimum(pd, dense(q_res, n)).sum()),
           "residual_uncapped": float(np.minimum(pd, qf).sum()),
           "coupled": coupled_exact(pd, qf),
           "coupled_mc": coupled_monte_carlo(p, q_full, position, draws) if draws else float("nan"),
           "draft_argmax": float(pd[int(np.argmax(d_logits))])}
    return row, p


def run_prompt(target: Model, draft: Model, prompt: str, params: SamplingParams, n_tokens: int,
               draws: int, rng: np.random.Generator) -> list[dict[str, float]]:
    """Sample up to n_tokens from the target, measuring every position on the way."""
    tokens = target.tokenize(target.chat_prompt([{"role": "user", "content": prompt}]))
    t_ctx, d_ctx = target.new_context(1024), draft.new_context(1024)
    try:
        batch, pos, rows = tokens, 0, []
        for _ in range(n_tokens):
            t_logits = t_ctx.decode(batch, pos)[0]
            d_logits = d_ctx.decode(batch, pos)[0]
            pos += len(batch)
            row, p = measure_position(t_logits, d_logits, params, pos, draws)
            rows.append(row)
            token = sample(p, rng)
            if target.is_end_of_generation(token):
                break
            batch = [token]
        return rows
    finally:
        t_ctx.close()
        d_ctx.close()


def summarise(rows: list[dict[str, float]], draws: int) -> dict[str, float]:
    keys = ("residual", "residual_uncapped", "coupled", "coupled_mc", "draft_argmax")
    out: dict[str, float] = {"positions": len(rows)}
    for key in keys:
        values = np.array([r[key] for r in rows])
        out[key] = float(values.mean())
        out[f"{key}_se_positions"] = float(values.std(ddof=1) / np.sqrt(len(values)))
    mc = np.array([r["coupled_mc"] for r in rows])
    # Noise-only error of the MC mean: each position is a mean of `draws` Bernoulli(a_t) draws.
    out["coupled_mc_se_noise"] = float(np.sqrt((mc * (1 - mc)).sum() / max(draws - 1, 1)) / len(rows))
    out["ratio_coupled_residual"] = out["coupled"] / out["residual"]
    out["ratio_coupled_residual_uncapped"] = out["coupled"] / out["residual_uncapped"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--positions", type=int, default=120, help="positions in all, split over the prompts")
    parser.add_argument("--noise-draws", type=int, default=400, help="Monte Carlo seeds per position (0: skip)")
    # 1, not 2: on a loaded 2-core machine llama.cpp's 2 threads spin-wait on each other (10x slower).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seeds the target's text sampling")
    parser.add_argument("--out", type=Path, default=ROOT / "scripts/bench-results/acceptance.json")
    args = parser.parse_args()

    target = Model(hub.resolve_model(args.target), threads=args.threads)
    draft = Model(hub.resolve_model(args.draft), threads=args.threads)
    per_prompt = -(-args.positions // len(PROMPTS))
    results = {"machine": {"cpu": cpu_model(), "threads": args.threads}, "target": args.target,
               "draft": args.draft, "top_k_cap": TOP_K_CAP, "noise_draws": args.noise_draws,
               "prompts": list(PROMPTS), "temperatures": {}}
    for temperature in args.temperatures:
        params, rng, start = SamplingParams(temperature=temperature), np.random.default_rng(args.seed), time.time()
        rows = [row for prompt in PROMPTS
                for row in run_prompt(target, draft, prompt, params, per_prompt, args.noise_draws, rng)]
        summary = summarise(rows, args.noise_draws)
        results["temperatures"][str(temperature)] = {"summary": summary, "per_position": rows}
        print(f"\nT={temperature}: {summary['positions']} positions, {time.time() - start:.0f} s")
        for key in ("residual", "residual_uncapped", "coupled", "coupled_mc", "draft_argmax"):
            print(f"  {key:18s} {summary[key]:.4f}  (se over positions {summary[key + '_se_positions']:.4f})")
        print(f"  coupled_mc se over the noise {summary['coupled_mc_se_noise']:.4f}")
        print(f"  coupled / residual: {summary['ratio_coupled_residual']:.3f} (capped q), "
              f"{summary['ratio_coupled_residual_uncapped']:.3f} (uncapped q)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    target.close()
    draft.close()


if __name__ == "__main__":
    main()

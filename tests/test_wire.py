"""Conversions between protobuf messages and duo's types."""

import numpy as np
import pytest

from duo import wire
from duo._proto import duo_pb2 as pb
from duo.sampling import SamplingParams, SparseDist


def test_sampling_params_and_seed_survive_the_wire():
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    back, seed = wire.sampling_from_pb(wire.sampling_to_pb(params, 42))
    assert seed == 42 and back.top_k == 40 and back.temperature == pytest.approx(0.7)
    assert wire.sampling_from_pb(wire.sampling_to_pb(params, None))[1] is None


def test_an_unset_top_p_means_no_nucleus_cut():
    assert wire.sampling_from_pb(pb.SamplingParams(temperature=1.0))[0].top_p == 1.0


def test_a_draft_distribution_is_renormalised_after_float32_rounding():
    q = wire.dist_from_pb(wire.dist_to_pb(SparseDist(np.array([5, 9]), np.array([0.3, 0.7]))))
    assert q.ids.tolist() == [5, 9] and q.probs.sum() == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("ids, probs", [([1, 2], [0.5]), ([1], [float("nan")]), ([1], [-1.0]), ([1], [0.0])])
def test_a_malformed_draft_distribution_is_refused(ids, probs):
    with pytest.raises(ValueError, match="distribution"):
        wire.dist_from_pb(pb.SparseDist(ids=ids, probs=probs))

"""The committed gRPC stubs are exactly what scripts/gen_proto.py generates from proto/duo.proto."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen_proto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_proto)
    for generated in gen_proto.generate(tmp_path):
        committed = ROOT / "duo" / "net" / "_proto" / generated.name
        assert committed.read_text() == generated.read_text(), (
            f"{committed} is stale: run `python scripts/gen_proto.py` and commit the result")

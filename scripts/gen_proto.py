"""Generate the Python gRPC stubs for proto/duo.proto into duo/net/_proto/ (run after editing the proto)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_root: Path) -> list[Path]:
    """Write duo/net/_proto/duo_pb2.py, duo_pb2.pyi and duo_pb2_grpc.py under `out_root`."""
    # Mapping proto/ to the virtual directory duo/net/_proto makes the generated modules import each
    # other as `duo.net._proto.duo_pb2`, so they work inside the package without sys.path tricks.
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{include}", f"-Iduo/net/_proto={ROOT / 'proto'}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", "duo/net/_proto/duo.proto"]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = out_root / "duo" / "net" / "_proto"
    return [out / name for name in ("duo_pb2.py", "duo_pb2.pyi", "duo_pb2_grpc.py")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write duo/net/_proto/ under")
    for path in generate(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

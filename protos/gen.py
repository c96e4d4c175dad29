"""Generate the Python protobuf/gRPC stubs from the .proto files: `make protos` after editing one.

The stubs are committed, not built: a clean clone, its sdist and its wheel hold them, so
`pip wheel .` needs no grpcio-tools (a 2.5 MB build dependency with protoc inside, and a
custom setuptools step) and an installed package imports exactly the code that was reviewed.
`tests/test_protos.py` fails when they differ from a fresh run of this (a .proto edited
without `make protos`); the dev extra pins grpcio-tools so that a fresh run is byte-identical.
The gencode checks the runtime at import: protobuf >= its `Protobuf Python Version` and
grpcio >= its GRPC_GENERATED_VERSION, the lower bounds in pyproject.toml's dependencies.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the folder that holds protos/
PROTO_DIR = Path(__file__).resolve().parent / "tokenrelay" / "v1"
PROTOS = ("generate.proto", "queue.proto")


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) into out_dir; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency only

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str((PROTO_DIR / p).relative_to(ROOT)) for p in PROTOS]
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    gen_dir = out_dir / PROTO_DIR.relative_to(ROOT)
    return sorted(p for p in gen_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def drift() -> list[str]:
    """Names of generated files that differ from what the protos produce now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for f in fresh:
            on_disk = PROTO_DIR / f.name
            if not on_disk.exists() or on_disk.read_bytes() != f.read_bytes():
                stale.append(f.name)
        return stale


def main() -> int:
    for f in generate():
        print(f"generated {f.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

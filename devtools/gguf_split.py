"""Write a GGUF file as shards, the way llama.cpp's gguf-split does with --split-max-tensors.

`NAME-00001-of-0000N.gguf` ...: the first shard holds every metadata key, each shard whole
tensors, every shard the keys split.no, split.count and split.tensors.count. Written with the
`gguf` package's writer (llama.cpp's own Python one). With `block_order`, a file whose blocks
are stored in name order (blk.0, blk.1, blk.10, ...: older llama-quantize output such as the
default model's) is first put in block order, keeping the tensors outside blocks where they
were, so that a span of blocks lies in few shards.

    python -m devtools.gguf_split FILE OUT_DIR --max-tensors 95 [--file-order]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from swarm.model.gguf_shards import SPLIT_KEYS


def _block(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else None


def split_gguf(path: Path, out_dir: Path, max_tensors: int, block_order: bool = True) -> list[Path]:
    """The shards written in `out_dir` from the GGUF file `path`, at most `max_tensors`
    tensors each, the first first."""
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out_dir / path.name, arch, split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (*SPLIT_KEYS, "general.architecture"):
            continue  # the header's own counts, and keys the writer sets itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    if "general.alignment" in reader.fields:
        writer.data_alignment = int(reader.fields["general.alignment"].contents())
    tensors = list(reader.tensors)
    if block_order:
        first = next(i for i, t in enumerate(tensors) if _block(t.name) is not None)

        def key(item: tuple[int, object]) -> tuple[int, int]:
            i, t = item
            block = _block(t.name)
            return (block if block is not None else (-1 if i < first else 1 << 30)), i

        tensors = [t for _, t in sorted(enumerate(tensors), key=key)]
    for t in tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    shards = writer.format_shard_names(out_dir / path.name)
    writer.write_header_to_file()
    for kv in writer.kv_data:  # gguf-split sets split.count last: byte for byte its shards
        kv["split.count"] = kv.pop("split.count")
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--max-tensors", type=int, default=128, help="as gguf-split's (128)")
    p.add_argument("--file-order", action="store_true", help="keep the file's tensor order")
    a = p.parse_args()
    for shard in split_gguf(a.file, a.out_dir, a.max_tensors, not a.file_order):
        print(shard)


if __name__ == "__main__":
    main()

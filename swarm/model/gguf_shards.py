"""A GGUF model in one file or in shards as llama.cpp's gguf-split writes them.

`NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`: each shard is a GGUF file of whole
tensors with the keys split.no (from 0), split.count and split.tensors.count (the model's
tensors, all shards together); only the first holds the model's metadata. A process needs the
first shard and those holding the tensors it computes with, not the others. Which absent shard
holds a tensor only that shard's own header says; how many tensors the absent shards hold
together, split.tensors.count does (`holds_only`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from swarm.errors import MissingShards
from swarm.model.gguf_file import GGUFFile, TensorInfo

SHARD_NAME = re.compile(r"^(?P<model>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def shard_paths(path: Path) -> list[Path]:
    """Every shard of the model `path` is a shard of (named as llama.cpp names them), the
    first first; [path] for a file not named as a shard."""
    m = SHARD_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [
        path.with_name(f"{m['model']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]


def model_stem(path: Path) -> str:
    """The model's name from a file's: a shard's without its -0000K-of-0000N."""
    m = SHARD_NAME.match(path.name)
    return m["model"] if m else path.stem


class GGUFShards:
    """The shards of one model found beside `path` (any of them): the first one's metadata
    (`fields`, `lengths`), the tensors of those present (`tensors`, `read`, `mapped`, each from
    the file holding it), and the paths of those absent (`absent`)."""

    def __init__(self, path: str | os.PathLike):
        paths = shard_paths(Path(path))
        self.path, self.count = paths[0], len(paths)
        count = self.count
        if not self.path.exists():
            raise MissingShards(
                f"{self.path.name} is not in {self.path.parent}: the first shard of a split"
                " GGUF holds the model's metadata, which every node and client needs",
                (str(self.path),),
            )
        first = GGUFFile(self.path)
        self.fields, self.lengths = first.fields, first.lengths
        said = int(first.fields.get("split.count", 0))
        if said != count and not (count == 1 and said == 0):
            raise ValueError(
                f"{self.path.name} says it is one of {said} shards (split.count), its name"
                f" that it is one of {count}: rename it NAME-00001-of-{said:05d}.gguf as"
                " llama.cpp's gguf-split wrote it"
            )
        self.absent: list[Path] = []
        self._holder: dict[str, GGUFFile] = {}
        for i, p in enumerate(paths):
            if not p.exists():
                self.absent.append(p)
                continue
            f = first if i == 0 else GGUFFile(p)
            if int(f.fields.get("split.no", 0)) != i:
                raise ValueError(
                    f"{p.name} is shard {f.fields.get('split.no')} (split.no), not {i}"
                )
            self._holder |= dict.fromkeys(f.tensors, f)
        self.tensors: dict[str, TensorInfo] = {n: f.tensors[n] for n, f in self._holder.items()}
        self.total = int(first.fields.get("split.tensors.count", len(self.tensors)))

    @property
    def split(self) -> bool:
        return SHARD_NAME.match(self.path.name) is not None

    @property
    def complete(self) -> bool:
        return not self.absent

    def read(self, name: str) -> np.ndarray:
        return self._holder[name].read(name)

    def mapped(self, name: str) -> np.ndarray:
        return self._holder[name].mapped(name)

    def files_of(self, names: set[str]) -> list[Path]:
        """The shards holding tensors `names` (all present), the first first."""
        return sorted({self._holder[n].path for n in names})

    def holds_only(self, expected: set[str]) -> bool:
        """Whether the absent shards hold exactly the tensors of `expected` not present here,
        by count: then they hold no other (no LM head, no RoPE table)."""
        return self.total - len(self.tensors) == len(expected - self.tensors.keys())

    def need(self, names: set[str], what: str) -> None:
        """MissingShards naming the absent shards where `names` are not all present."""
        lacking = sorted(names - self.tensors.keys())
        if not lacking:
            return
        if self.complete:
            raise ValueError(f"{self.path.name} has no tensor {', '.join(lacking[:4])}")
        tensors = lacking[0] if len(lacking) == 1 else f"{len(lacking)} tensors ({lacking[0]}, ...)"
        raise MissingShards(self.lacking(what, tensors), tuple(map(str, self.absent)))

    def lacking(self, what: str, tensors: str) -> str:
        here = ", ".join(p.name for p in shard_paths(self.path) if p not in self.absent)
        return (
            f"{what} needs {tensors}, in none of the shards here ({here}) but in one or more"
            f" of the model's missing shards: {', '.join(p.name for p in self.absent)} (put"
            f" them in {self.path.parent})"
        )

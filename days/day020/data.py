"""Day 020's training data: the Python standard library's own source, as bytes.

Every machine with Python has it, so there is nothing to download:

    python -m days.day020.data build/day020/data     # writes train.bin, val.bin, meta.json

Tokens are bytes (vocabulary 256). Files are taken in sorted order of their path below the
standard library; a file goes to validation when a hash of its path falls in the last
`val_percent` of the range, so the split is the same wherever the same files exist (a
different Python version has different files: `meta.json` records which one and a hash of
the tokens). Each `.bin` is written to a temporary file and renamed, so a reader never sees
half a file, and read back as a memory map.

`Batches` draws windows from a token file: step `i` of a run with seed `s` always gets the
same batch, which is what makes a resumed run continue exactly where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmark.store import write_atomically

VOCAB = 256  # byte-level
SEPARATOR = b"\n\n"  # between files


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's .py files (no site-packages, no tests), in a fixed order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative_path: str, val_percent: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 >= 1 - val_percent / 100


def build(out_dir: Path, *, root: Path | None = None, val_percent: float = 10.0, max_bytes: int | None = None) -> dict:
    """Write train.bin and val.bin (uint8 tokens) and meta.json into `out_dir`; return
    the meta. `max_bytes` caps the corpus for quick runs: each split takes the files,
    in order, that still fit its share."""
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must be in (0, 100), got {val_percent}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    # with a cap, each split fills its share of it, taking the files that still fit
    room = {"train": math.inf, "val": math.inf}
    if max_bytes is not None:
        room = {"train": max_bytes * (1 - val_percent / 100), "val": max_bytes * val_percent / 100}
    for path in files:
        split = "val" if is_validation(path.relative_to(root).as_posix(), val_percent) else "train"
        if path.stat().st_size + len(SEPARATOR) > room[split]:
            continue
        data = path.read_bytes() + SEPARATOR
        room[split] -= len(data)
        parts[split].append(data)
    if not parts["train"] or not parts["val"]:
        raise ValueError(
            f"the split left no {'train' if not parts['train'] else 'validation'} data (max_bytes too small?)"
        )
    meta = {"vocab": VOCAB, "python": sys.version.split()[0], "root": str(root), "val_percent": val_percent}
    out_dir = Path(out_dir)
    for split, chunks in parts.items():
        blob = b"".join(chunks)
        write_atomically(out_dir / f"{split}.bin", blob)
        meta[split] = {"tokens": len(blob), "files": len(chunks), "sha256": hashlib.sha256(blob).hexdigest()}
    write_atomically(out_dir / "meta.json", json.dumps(meta, indent=2).encode())
    return meta


def load(out_dir: Path, split: str) -> np.memmap:
    """The tokens of `split` ('train' or 'val') as a read-only memory map."""
    path = Path(out_dir) / f"{split}.bin"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m days.day020.data {out_dir}` first")
    return np.memmap(path, dtype=np.uint8, mode="r")


@dataclass(frozen=True)
class Batches:
    """Random windows of `seq + 1` tokens: inputs are the first `seq`, targets the last."""

    tokens: np.ndarray
    batch: int
    seq: int
    seed: int

    def __post_init__(self):
        if len(self.tokens) < self.seq + 2:
            raise ValueError(f"{len(self.tokens)} tokens cannot make windows of {self.seq + 1}")

    def get(self, step: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)  # a pure function of (seed, step)
        starts = torch.randint(0, len(self.tokens) - self.seq - 1, (self.batch,), generator=g).tolist()
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq + 1], dtype=np.int64) for s in starts])
        both = torch.from_numpy(rows)
        return both[:, :-1].to(device), both[:, 1:].to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--val-percent", type=float, default=10.0)
    p.add_argument("--max-bytes", type=int, default=None)
    args = p.parse_args(argv)
    meta = build(args.out_dir, val_percent=args.val_percent, max_bytes=args.max_bytes)
    print(f"train {meta['train']['tokens']:,} tokens, val {meta['val']['tokens']:,} (Python {meta['python']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cuts the MNIST subset in test-data/mnist/ out of the canonical MNIST files.

Usage: python3 test-data/make_mnist_subset.py SRC_DIR [N_TRAIN N_TEST]
SRC_DIR holds the four canonical *-ubyte.gz files (sha256 in test-data/README.md). Writes the
first N_TRAIN training and the first N_TEST test images and labels, same IDX format with the
count rewritten, gzip level 9 with mtime 0 and no file name, so the output is reproducible.
Python is needed only to regenerate the subset, never to build or run Kolo.
"""
import gzip
import io
import struct
import sys
from pathlib import Path

src = Path(sys.argv[1])
n_train = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
n_test = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
out = Path(__file__).resolve().parent / "mnist"
out.mkdir(exist_ok=True)

for split, n in (("train", n_train), ("t10k", n_test)):
    for kind, magic, item in (("images-idx3", 0x803, 784), ("labels-idx1", 0x801, 1)):
        name = f"{split}-{kind}-ubyte.gz"
        raw = gzip.decompress((src / name).read_bytes())
        header = 16 if kind.startswith("images") else 8
        got_magic, count = struct.unpack(">II", raw[:8])
        assert got_magic == magic and n <= count, (name, got_magic, count)
        body = raw[8:header] + raw[header : header + n * item]
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
            f.write(struct.pack(">II", magic, n) + body)
        (out / name).write_bytes(buf.getvalue())
        print(name, n, len(buf.getvalue()))

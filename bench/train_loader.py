"""Training throughput: our loaders against a plain DataLoader that decodes JPEGs with PIL.

Same run, same network, same head, same batch: images/s of full training steps (forward,
A-Softmax m = 4, backward, SGD) fed by

* ``device``: :class:`training.data.DeviceResidentLoader` (uint8 dataset in device memory),
* ``stream``: :class:`training.data.StreamingLoader` (memory-mapped shards, pinned buffers,
  asynchronous copies),
* ``dataloader``: ``torch.utils.data.DataLoader`` over the same aligned crops saved as JPEG
  files (quality 95), decoded with PIL in ``--workers`` processes, flipped and normalised there,
  ``pin_memory=True`` (the way most SphereFace/ArcFace PyTorch projects feed their GPUs).

Goal: 10,000 images/s or more for SphereFace-20, batch 256, bf16, on one H100 with
our loader. Usage::

    python bench/train_loader.py --data .cache/data/celeba_faces --network sphereface20 \\
        --batch-size 256 --steps 200 --device cuda --json docs/results/bench_train_loader.json

On CPU (no GPU) use a small network and few steps; the numbers then measure the CPU, not the
loader.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.config import TrainConfig  # noqa: E402
from training.data import DeviceResidentLoader, StreamingLoader  # noqa: E402
from training.prepare import load_prepared  # noqa: E402
from training.trainer import build_model  # noqa: E402


class JpegFolderDataset(torch.utils.data.Dataset):
    """Aligned crops as JPEG files, decoded with PIL per item (the usual baseline)."""

    def __init__(self, files: list[Path], labels: np.ndarray) -> None:
        self.files = files
        self.labels = labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as img:
            array = np.asarray(img.convert("RGB"), dtype=np.float32)
        if np.random.default_rng().random() < 0.5:
            array = array[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
        return (x - 127.5) / 128.0, int(self.labels[i])


def write_jpegs(images: np.ndarray, labels: np.ndarray, folder: Path) -> list[Path]:
    files = []
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        path = folder / f"{label:05d}" / f"{i:07d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path, quality=95)
        files.append(path)
    return files


def run_steps(model, optimizer, batches, steps: int, warmup: int, device: torch.device, bf16: bool) -> float:
    """Images/s over ``steps`` training steps after ``warmup`` untimed ones."""
    it = iter(batches)
    model.train()
    seen = 0
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, seen = time.perf_counter(), 0
        images, labels = next(it)
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _, _ = model(images, labels, i)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += len(labels)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seen / (time.perf_counter() - start)


def endless(loader):
    while True:
        yield from loader


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--data", default=".cache/data/celeba_faces", help="a sphereface prepare folder")
    parser.add_argument("--network", default="sphereface20")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=8, help="DataLoader worker processes")
    parser.add_argument("--loaders", default="device,stream,dataloader")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    bf16 = device.type == "cuda"
    data = load_prepared(args.data)
    images, labels = data.concatenate()
    config = TrainConfig(network=args.network, head="asoftmax", head_options={"m": 4}, steps=28000)
    model = build_model(config, data.num_classes).to(device)
    if device.type == "cuda":
        model.net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_jpeg_") as tmp:
        for kind in args.loaders.split(","):
            if kind == "device":
                batches = DeviceResidentLoader(images, labels, args.batch_size, device)
            elif kind == "stream":
                batches = StreamingLoader(data.shards, args.batch_size, device)
            elif kind == "dataloader":
                files = write_jpegs(images, labels, Path(tmp))
                batches = endless(
                    torch.utils.data.DataLoader(
                        JpegFolderDataset(files, labels), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda", drop_last=True,
                        persistent_workers=args.workers > 0,
                    )
                )  # fmt: skip
            else:
                raise SystemExit(f"unknown loader {kind!r}")
            results[kind] = run_steps(model, optimizer, batches, args.steps, args.warmup, device, bf16)
            print(f"{kind:>10}: {results[kind]:9.1f} images/s", flush=True)
    if "dataloader" in results:
        for kind in ("device", "stream"):
            if kind in results:
                print(f"{kind} / dataloader: {results[kind] / results['dataloader']:.2f}x")
    report = {
        "network": args.network,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "precision": "bf16" if bf16 else "fp32",
        "dataloader_workers": args.workers,
        "images_per_s": results,
        "torch": torch.__version__,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training batches from a prepared dataset (``sphereface prepare``), fast enough to keep a GPU busy.

Two loaders yield the same thing, ``(images, labels)`` on the training device: images
``(B, 3, 112, 96)`` float32 RGB normalised as ``(x - 127.5) / 128`` (channels-last memory),
randomly mirrored when ``flip`` is on, and labels ``(B,)`` int64.

* :class:`DeviceResidentLoader`: the whole dataset lives on the device as uint8 (32 KB per face:
  CASIA-WebFace's 0.49M faces are 16 GB); sampling, flipping and normalisation are tensor ops
  there, so no worker process, no JPEG decoding and no host-to-device copy happens per step.
  On CPU the same code runs from host memory.
* :class:`StreamingLoader`: for datasets larger than the device. A background thread walks the
  shards (memory-mapped ``.npy`` files) in random order, shuffles faces across a window of
  shards, gathers each batch into one of several pinned host buffers and copies it to the device
  asynchronously; flipping and normalisation then run on the device.

Both are infinite iterators over epochs. Under ``torchrun`` each process gets a disjoint share
of every epoch (same permutation seed on all ranks, rank ``r`` takes every ``world``-th index)
and a ``batch_size`` of its own (the global batch divided by the number of processes).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

PIXEL_MEAN = 127.5
PIXEL_STD = 128.0


def to_network_input(batch: torch.Tensor, flip_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H, W, 3)`` uint8 RGB -> ``(B, 3, H, W)`` float32 ``(x - 127.5) / 128``, on its device.

    ``flip_mask`` ``(B,)`` bool mirrors the chosen images horizontally. The result is laid out
    channels-last (the permute of the NHWC input), which is what cuDNN's fastest kernels read.
    """
    x = batch.permute(0, 3, 1, 2).float()
    if flip_mask is not None:
        x = torch.where(flip_mask[:, None, None, None], x.flip(3), x)
    return x.sub_(PIXEL_MEAN).div_(PIXEL_STD)


class _FlipAndNormalise:
    """uint8 NHWC batch on the device -> network input, each face mirrored with probability 0.5.

    Seeded per process (``seed * 1000 + rank``) so ranks flip independently and runs repeat.
    """

    def __init__(self, device: torch.device, enabled: bool, seed: int, rank: int) -> None:
        self.device = device
        self.enabled = enabled
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed * 1000 + rank)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        mask = None
        if self.enabled:
            mask = torch.rand(len(images), device=self.device, generator=self.generator) < 0.5
        return to_network_input(images, mask)


class DeviceResidentLoader:
    """Random batches sampled from a uint8 dataset that sits entirely in device memory.

    Args:
        images: ``(N, H, W, 3)`` uint8 (numpy or memmap; copied to ``device`` once).
        labels: ``(N,)`` integer class labels.
        batch_size: faces per batch of this process.
        device: where the data and the batches live.
        flip: mirror each face with probability 0.5.
        seed: the epoch permutations are ``seed + epoch``-seeded and identical on every rank.
        rank, world_size: this process's share of every epoch under torchrun.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch_size: int,
        device: torch.device | str,
        *,
        flip: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.device = torch.device(device)
        self.images = torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
        self.labels = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(self.device)
        self.batch_size = batch_size
        self.flip = flip
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.per_rank = len(images) // world_size
        if self.per_rank < batch_size:
            raise ValueError(
                f"{len(images)} faces over {world_size} processes is fewer than one batch of {batch_size}"
            )
        self._augment = _FlipAndNormalise(self.device, flip, seed, rank)
        self.epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.per_rank // self.batch_size

    def _epoch_indices(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.labels), generator=generator)
        mine = order[self.rank :: self.world_size][: self.per_rank]
        return mine.to(self.device, non_blocking=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            indices = self._epoch_indices(self.epoch)
            for b in range(self.batches_per_epoch):
                idx = indices[b * self.batch_size : (b + 1) * self.batch_size]
                yield self._augment(self.images.index_select(0, idx)), self.labels.index_select(0, idx)
            self.epoch += 1


class StreamingLoader:
    """Batches streamed from memory-mapped shards through pinned memory with asynchronous copies.

    Args:
        shards: ``[(images (n, H, W, 3) uint8 memmap, labels (n,))...]`` as
            :class:`training.prepare.PreparedDataset` holds them.
        batch_size: faces per batch of this process.
        device: the training device.
        window: shards mixed together before shuffling (more: better mixing, more host memory).
        prefetch: batches prepared ahead (also the number of pinned buffers minus one).
        flip, seed, rank, world_size: as :class:`DeviceResidentLoader`; each rank reads its own
            shards (every ``world``-th of the epoch's shard order) when there are enough shards,
            otherwise every rank reads all shards and keeps its share of the faces.
    """

    def __init__(
        self,
        shards: Sequence[tuple[np.ndarray, np.ndarray]],
        batch_size: int,
        device: torch.device | str,
        *,
        flip: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        window: int = 2,
        prefetch: int = 4,
    ) -> None:
        if not shards:
            raise ValueError("no shards to stream")
        self.shards = list(shards)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.flip = flip
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.window = max(1, window)
        self.prefetch = max(1, prefetch)
        shape = self.shards[0][0].shape[1:]
        pin = self.device.type == "cuda"
        slots = range(self.prefetch + 1)
        self._buffers = [torch.empty((batch_size, *shape), dtype=torch.uint8, pin_memory=pin) for _ in slots]
        self._label_buffers = [torch.empty(batch_size, dtype=torch.int64, pin_memory=pin) for _ in slots]
        #: CUDA event recorded after the copy out of each pinned buffer; the producer waits on it
        #: before refilling that buffer, so a copy still in flight is never overwritten.
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._buffers)
        self._augment = _FlipAndNormalise(self.device, flip, seed, rank)
        self.epoch = 0

    def _epoch_batches(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(self.seed + epoch)
        order = rng.permutation(len(self.shards))
        split_shards = len(self.shards) >= self.world_size
        if split_shards:
            order = order[self.rank :: self.world_size]
        for start in range(0, len(order), self.window):
            group = [self.shards[i] for i in order[start : start + self.window]]
            images = np.concatenate([np.asarray(g[0]) for g in group])
            labels = np.concatenate([np.asarray(g[1], dtype=np.int64) for g in group])
            perm = rng.permutation(len(labels))
            if not split_shards:
                perm = perm[self.rank :: self.world_size]
            for b in range(len(perm) // self.batch_size):
                idx = np.sort(perm[b * self.batch_size : (b + 1) * self.batch_size])
                yield images[idx], labels[idx]

    def _producer(self, out: queue.Queue, stop: threading.Event) -> None:
        slot = 0
        try:
            while not stop.is_set():
                produced = False
                for images, labels in self._epoch_batches(self.epoch):
                    buffer, label_buffer = self._buffers[slot], self._label_buffers[slot]
                    event = self._copied[slot]
                    if event is not None:
                        event.synchronize()
                    buffer.numpy()[...] = images
                    label_buffer.numpy()[...] = labels
                    while not stop.is_set():
                        try:
                            out.put((slot, buffer, label_buffer), timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    slot = (slot + 1) % len(self._buffers)
                    produced = True
                    if stop.is_set():
                        return
                self.epoch += 1
                if not produced:
                    raise ValueError(f"no shard window holds a full batch of {self.batch_size} faces")
        except BaseException as exc:  # hand the error to the consumer instead of hanging it
            out.put(exc)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        out: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch - 1))
        stop = threading.Event()
        thread = threading.Thread(target=self._producer, args=(out, stop), daemon=True, name="shard-stream")
        thread.start()
        try:
            while True:
                item = out.get()
                if isinstance(item, BaseException):
                    raise item
                slot, buffer, label_buffer = item
                images = buffer.to(self.device, non_blocking=True)
                labels = label_buffer.to(self.device, non_blocking=True)
                if self.device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                    self._copied[slot] = event
                else:
                    images, labels = images.clone(), labels.clone()
                yield self._augment(images), labels
        finally:
            stop.set()
            thread.join(timeout=5)


def fits_on_device(num_bytes: int, device: torch.device, share: float = 0.5) -> bool:
    """Whether ``num_bytes`` of uint8 faces fit in ``share`` of the device's free memory."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes <= share * free

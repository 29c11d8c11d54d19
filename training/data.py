"""Training batches from a prepared dataset (``sphereface prepare``), fast enough to keep a GPU busy.

Two loaders yield the same batches, ``(images, labels)`` on the training device: images
``(B, 3, 112, 96)`` float32 RGB normalised as ``(x - 127.5) / 128`` (channels-last memory),
randomly mirrored when ``flip`` is on and, when a config's ``augment`` table asks, moved, recoloured
and partly erased (:mod:`training.augment`), and labels ``(B,)`` int64.

* :class:`DeviceResidentLoader`: the whole dataset lives on the device as uint8 (32 KB per face:
  CASIA-WebFace's 0.49M faces are 16 GB), copied there shard by shard (no host copy of the whole
  set); sampling, flipping and normalisation are tensor ops there, so no worker process, no JPEG
  decoding and no host-to-device copy happens per step. On CPU the same code runs from host memory.
* :class:`StreamingLoader`: for datasets larger than the device. A background thread gathers each
  batch's faces from the memory-mapped shards into one of several pinned host buffers and copies
  it to the device asynchronously; flipping and normalisation then run on the device.

Sampling is the same in both (:func:`epoch_order`): one uniform permutation of the *whole* set
per epoch, seeded by ``seed + epoch`` and identical on every rank. Under ``torchrun`` rank ``r``
takes every ``world``-th face of it, cut to the same length on every rank, so ranks get disjoint,
equal shares and their epochs stay in step. Shards are runs of consecutive identities: sampling
within a window of shards would draw each batch from a few percent of the identities.

Both are infinite iterators over epochs whose position can be saved and restored exactly
(:meth:`state_dict` / :meth:`load_state_dict`: epoch, batches already taken in it, and the
augmentation's generator), which is what makes a resumed run equal to an uninterrupted one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

# the network input and its augmentation (re-exported: the trainer and tests read them from here)
from training.augment import PIXEL_MEAN, PIXEL_STD, AugmentOptions, BatchAugment, to_network_input

__all__ = [
    "PIXEL_MEAN", "PIXEL_STD", "AugmentOptions", "DeviceResidentLoader", "StreamingLoader",
    "epoch_order", "fits_on_device", "to_network_input",
]  # fmt: skip


def epoch_order(num_faces: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """This rank's faces of ``epoch``, in order: a share of one uniform permutation of all faces.

    The permutation is seeded by ``seed + epoch`` (the same on every rank); rank ``r`` takes
    every ``world_size``-th entry from ``r``, cut to ``num_faces // world_size`` so that every
    rank has the same number of batches.
    """
    order = np.random.default_rng(seed + epoch).permutation(num_faces)
    return order[rank::world_size][: num_faces // world_size]


class _EpochLoader:
    """What both loaders share: the epoch plan, the position in it and its saved state."""

    batch_size: int
    seed: int
    rank: int
    world_size: int
    num_faces: int
    _augment: BatchAugment

    def _init_position(self) -> None:
        per_rank = self.num_faces // self.world_size
        if per_rank < self.batch_size:
            raise ValueError(
                f"{self.num_faces} faces over {self.world_size} processes is fewer than one batch "
                f"of {self.batch_size}"
            )
        #: Epochs completed, and batches of the current epoch already handed out.
        self.epoch = 0
        self.position = 0

    @property
    def batches_per_epoch(self) -> int:
        return (self.num_faces // self.world_size) // self.batch_size

    def _batch_indices(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(epoch, position after this batch, face indices)`` from the current position on."""
        epoch, position = self.epoch, self.position
        while True:
            order = epoch_order(self.num_faces, self.seed, epoch, self.rank, self.world_size)
            for b in range(position, self.batches_per_epoch):
                yield epoch, b + 1, order[b * self.batch_size : (b + 1) * self.batch_size]
            epoch, position = epoch + 1, 0

    def _advance(self, epoch: int, position: int) -> None:
        """Record that the batch ending at ``position`` of ``epoch`` has been handed out."""
        if position == self.batches_per_epoch:
            self.epoch, self.position = epoch + 1, 0
        else:
            self.epoch, self.position = epoch, position

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: epoch, position and the flip generator's state."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "flip_generator": self._augment.generator.get_state(),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "num_faces": self.num_faces,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where :meth:`state_dict` was taken (same data, batch and processes)."""
        same = (state["batch_size"], state["world_size"], state["num_faces"])
        if same != (self.batch_size, self.world_size, self.num_faces):
            raise ValueError(
                f"loader state of batch {state['batch_size']} x {state['world_size']} processes over "
                f"{state['num_faces']} faces cannot continue as batch {self.batch_size} x "
                f"{self.world_size} over {self.num_faces}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._augment.generator.set_state(state["flip_generator"])


class DeviceResidentLoader(_EpochLoader):
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
        augment: AugmentOptions | None = None,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.device = torch.device(device)
        self.images = torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
        self.labels = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(self.device)
        self._setup(batch_size, flip, seed, rank, world_size, augment)

    @classmethod
    def from_shards(
        cls,
        shards: Sequence[tuple[np.ndarray, np.ndarray]],
        batch_size: int,
        device: torch.device | str,
        **options: Any,
    ) -> DeviceResidentLoader:
        """The loader of a prepared dataset's shards, copied to the device one shard at a time.

        Host memory holds at most one shard at once (under torchrun every rank does this, so a
        whole-set host copy per rank would multiply the host memory by the number of GPUs).
        """
        if not shards:
            raise ValueError("no shards to load")
        total = sum(len(labels) for _, labels in shards)
        loader = cls.__new__(cls)
        loader.device = torch.device(device)
        loader.images = torch.empty((total, *shards[0][0].shape[1:]), dtype=torch.uint8, device=loader.device)
        loader.labels = torch.empty(total, dtype=torch.int64, device=loader.device)
        at = 0
        for images, labels in shards:
            n = len(labels)
            loader.images[at : at + n].copy_(torch.from_numpy(np.array(images)))  # one shard in host memory
            loader.labels[at : at + n].copy_(torch.from_numpy(np.asarray(labels, dtype=np.int64)))
            at += n
        loader._setup(batch_size, **options)
        return loader

    def _setup(
        self,
        batch_size: int,
        flip: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        augment: AugmentOptions | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.flip = flip
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_faces = len(self.labels)
        self._init_position()
        self._augment = BatchAugment(self.device, flip, seed, rank, augment)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for epoch, position, indices in self._batch_indices():
            idx = torch.from_numpy(indices).to(self.device, non_blocking=True)
            images, labels = self.images.index_select(0, idx), self.labels.index_select(0, idx)
            self._advance(epoch, position)
            yield self._augment(images), labels


class StreamingLoader(_EpochLoader):
    """Batches gathered from memory-mapped shards through pinned memory with asynchronous copies.

    Args:
        shards: ``[(images (n, H, W, 3) uint8 memmap, labels (n,))...]`` as
            :class:`training.prepare.PreparedDataset` holds them.
        batch_size: faces per batch of this process.
        device: the training device.
        prefetch: batches prepared ahead (also the number of pinned buffers minus one).
        flip, seed, rank, world_size: as :class:`DeviceResidentLoader` (and the same batches).
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
        prefetch: int = 4,
        augment: AugmentOptions | None = None,
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
        self.prefetch = max(1, prefetch)
        sizes = [len(labels) for _, labels in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._labels = np.concatenate([np.asarray(labels, dtype=np.int64) for _, labels in self.shards])
        self.num_faces = int(self._starts[-1])
        self._init_position()
        shape = self.shards[0][0].shape[1:]
        pin = self.device.type == "cuda"
        slots = range(self.prefetch + 1)
        self._buffers = [torch.empty((batch_size, *shape), dtype=torch.uint8, pin_memory=pin) for _ in slots]
        self._label_buffers = [torch.empty(batch_size, dtype=torch.int64, pin_memory=pin) for _ in slots]
        #: CUDA event recorded after the copy out of each pinned buffer; the producer waits on it
        #: before refilling that buffer, so a copy still in flight is never overwritten.
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._buffers)
        self._augment = BatchAugment(self.device, flip, seed, rank, augment)

    def _gather(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Copy faces ``indices`` (global, in batch order) into ``out``, reading shard by shard."""
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        for k in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == k)
            local = indices[rows] - self._starts[k]
            order = np.argsort(local, kind="stable")  # ascending reads of the memmap
            out[rows[order]] = self.shards[k][0][local[order]]

    def _producer(self, out: queue.Queue, stop: threading.Event) -> None:
        slot = 0
        try:
            for epoch, position, indices in self._batch_indices():
                if stop.is_set():
                    return
                buffer, label_buffer = self._buffers[slot], self._label_buffers[slot]
                event = self._copied[slot]
                if event is not None:
                    event.synchronize()
                self._gather(indices, buffer.numpy())
                label_buffer.numpy()[...] = self._labels[indices]
                while not stop.is_set():
                    try:
                        out.put((slot, buffer, label_buffer, epoch, position), timeout=0.5)
                        break
                    except queue.Full:
                        continue
                slot = (slot + 1) % len(self._buffers)
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
                slot, buffer, label_buffer, epoch, position = item
                images = buffer.to(self.device, non_blocking=True)
                labels = label_buffer.to(self.device, non_blocking=True)
                if self.device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                    self._copied[slot] = event
                else:
                    images, labels = images.clone(), labels.clone()
                # The position follows what the consumer received, not what the producer read ahead.
                self._advance(epoch, position)
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

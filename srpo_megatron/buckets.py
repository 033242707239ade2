"""Size-bounded buckets for weight transfer: a leaf (torch only, no srpo_megatron import), so that both
the trainer's senders (``weights/``) and the rollout engines (``rollout/``) use it without ``rollout/``
importing ``weights/``.

Two kinds:

- ``bucketize`` / ``bucketize_pending``: a bucket is a list of separately allocated ``(name, tensor)``;
- ``flat_buckets``: a bucket is ONE byte buffer (``FlatBucket``) that each parameter's HF tensors are
  written into at planned, aligned offsets (slime's / SGLang's ``FlattenedTensorBucket`` layout). The
  buffer is allocated at its exact planned size before the first parameter of the bucket is gathered, the
  gathers write straight into it where the layout allows (``weights.export``), it travels as one tensor
  (one collective per bucket instead of one per tensor) and it is freed as a whole: no allocator
  fragmentation from hundreds of per-tensor buffers (glibc's heap on CPU, the caching allocator on GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

ALIGN = 256  # byte alignment of each tensor in a flat bucket (any dtype view; coalesced GPU copies)

# SGLang's DeepSeek-V3 loader (``deepseek_v2.py``, ``fuse_qkv_a_proj``) loads a layer's ``q_a_proj`` and
# ``kv_a_proj_with_mqa`` as ONE fused parameter, and only when both arrive in the same ``load_weights`` call
# (one update request, i.e. one bucket); split over two, it drops both silently. So no bucket closes while a
# layer's pair is open: a bucket may then exceed ``bucket_bytes`` by the tensors between the two (part of one
# attention layer). ``tests/sglang_real/test_sglang_deepseek.py`` feeds SGLang's loader bucket by bucket.
# An FP8 sync (``weights.fp8_sync``) sends each ``weight_scale_inv`` just before its weight, and SGLang fuses
# the two scales the same way: the pair opens at the first of q_a's tensors and closes at kv_a's weight.
_PAIR_OPEN, _PAIR_CLOSE = ".self_attn.q_a_proj.weight", ".self_attn.kv_a_proj_with_mqa.weight"
_PAIR_OPEN_SCALE = _PAIR_OPEN + "_scale_inv"


class _FusedPairs:
    """The layers whose ``q_a_proj`` is in the current bucket and whose ``kv_a_proj_with_mqa`` is not yet."""

    def __init__(self) -> None:
        self.open: set[str] = set()

    def add(self, name: str) -> None:
        if name.endswith(_PAIR_OPEN):
            self.open.add(name[: -len(_PAIR_OPEN)])
        elif name.endswith(_PAIR_OPEN_SCALE):
            self.open.add(name[: -len(_PAIR_OPEN_SCALE)])
        elif name.endswith(_PAIR_CLOSE):
            self.open.discard(name[: -len(_PAIR_CLOSE)])


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor a parameter will produce: name, dtype and shape, known before gathering."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class PendingParam:
    """One parameter not yet gathered: its HF byte size is known, ``fetch()`` materialises it."""

    name: str  # global megatron name
    nbytes: int  # bytes ``fetch()`` will return on this rank (0 where it returns nothing)
    fetch: Callable[[], list[tuple[str, torch.Tensor]]]
    # What ``fetch`` returns on this rank, in order (empty where it returns nothing); None: unknown.
    specs: tuple[TensorSpec, ...] | None = None
    # ``fetch_into(out)`` writes the tensors of ``specs`` into the views ``out`` (same collectives as
    # ``fetch``); None: ``fetch`` and copy.
    fetch_into: Callable[[list[torch.Tensor]], None] | None = None


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into lists of at most ``bucket_bytes`` (a tensor larger than that goes alone; a
    DeepSeek-V3 q_a/kv_a pair is never split, see ``_PAIR_OPEN``)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, pairs = 0, _FusedPairs()
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes and not pairs.open:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        pairs.add(name)
        size += nbytes
    if bucket:
        yield bucket


def bucketize_pending(
    pending: Iterable[PendingParam], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Like ``bucketize`` but decides *before* fetching: the current bucket is handed out (and released by
    the consumer) before a parameter that would overflow it is materialised. Every ``fetch`` is called,
    in order, also on ranks that get nothing (it may be a collective)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, pairs = 0, _FusedPairs()
    for p in pending:
        if bucket and size + p.nbytes > bucket_bytes and not pairs.open:
            yield bucket
            bucket, size = [], 0
        tensors = p.fetch()
        bucket.extend(tensors)
        for name, _ in tensors:
            pairs.add(name)
        size += sum(t.numel() * t.element_size() for _, t in tensors)
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class FlatBucket:
    """Tensors laid out in one uint8 buffer: tensor ``i`` is ``flat[offsets[i]:][:nbytes]`` viewed as
    ``dtypes[i]`` with ``shapes[i]``. ``meta()`` is what the wire format sends ahead of ``flat``."""

    flat: torch.Tensor  # uint8 [total bytes, alignment padding included]
    specs: list[TensorSpec]
    offsets: list[int]

    @property
    def nbytes(self) -> int:
        """Payload bytes (without alignment padding)."""
        return sum(s.nbytes for s in self.specs)

    def views(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, _view(self.flat, o, s)) for s, o in zip(self.specs, self.offsets, strict=True)]

    def meta(self) -> dict:
        return {
            "names": [s.name for s in self.specs],
            "dtypes": [str(s.dtype).removeprefix("torch.") for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
            "offsets": self.offsets,
            "flat_bytes": self.flat.numel(),
        }

    @classmethod
    def empty(cls, specs: Sequence[TensorSpec], device: torch.device | str = "cpu") -> FlatBucket:
        """An uninitialised bucket for ``specs``, each at the next ``ALIGN``-byte offset."""
        offsets, total = [], 0
        for s in specs:
            offsets.append(total)
            total += _aligned(s.nbytes)
        return cls(torch.empty(total, dtype=torch.uint8, device=device), list(specs), offsets)

    @classmethod
    def from_meta(cls, meta: dict, device: torch.device | str = "cpu") -> FlatBucket:
        """The receive buffer for a bucket whose ``meta()`` arrived."""
        specs = [
            TensorSpec(n, getattr(torch, d), tuple(s))
            for n, d, s in zip(meta["names"], meta["dtypes"], meta["shapes"], strict=True)
        ]
        flat = torch.empty(int(meta["flat_bytes"]), dtype=torch.uint8, device=device)
        return cls(flat, specs, [int(o) for o in meta["offsets"]])


def _view(flat: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    return flat[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def streamed_views(bucket: FlatBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Consume ``bucket``: its tensors as views, except the last, which is a copy. A streaming consumer
    still holds the tensor it got last while it asks for the next one, and a view would keep the whole
    buffer alive while the next bucket is built (two buckets instead of one bucket plus one tensor)."""
    specs, offsets = bucket.specs, bucket.offsets
    flat, bucket.flat = bucket.flat, bucket.flat.new_empty(0)
    for k, (spec, offset) in enumerate(zip(specs, offsets, strict=True)):
        t = _view(flat, offset, spec)
        if k == len(specs) - 1:
            t = t.clone()
            del flat
        yield spec.name, t


def flat_buckets(
    pending: Iterable[PendingParam], bucket_bytes: int, device: torch.device | str = "cpu"
) -> Iterator[FlatBucket]:
    """Group parameters into flat buckets of at most ``bucket_bytes`` (alignment included; a parameter
    larger than that goes alone), decided *before* fetching from the announced ``specs``. Each bucket's
    buffer is allocated when its plan is complete, then every parameter of it is written in place
    (``fetch_into``). Every ``fetch``/``fetch_into`` is called in order, also on ranks that get nothing
    (it may be a collective); a rank that gets nothing yields nothing.

    The consumer must release a bucket before asking for the next: a sender then holds one bucket plus
    what the gather of one parameter needs (``weights.export``)."""
    plan: list[PendingParam] = []
    size, pairs = 0, _FusedPairs()

    def build(params: list[PendingParam]) -> FlatBucket:
        bucket = FlatBucket.empty([s for p in params for s in p.specs], device)
        views = [t for _, t in bucket.views()]
        k = 0
        for p in params:
            n = len(p.specs)
            _fill(p, views[k : k + n])
            k += n
        return bucket

    for p in pending:
        if p.nbytes == 0:
            if plan:  # keep the collectives in model order
                yield build(plan)
                plan, size = [], 0
            p.fetch()
            continue
        if p.specs is None:
            raise ValueError(f"parameter {p.name} announces {p.nbytes} bytes but not its tensors (specs)")
        need = sum(_aligned(s.nbytes) for s in p.specs)
        if plan and size + need > bucket_bytes and not pairs.open:
            yield build(plan)
            plan, size = [], 0
        plan.append(p)
        for spec in p.specs:
            pairs.add(spec.name)
        size += need
    if plan:
        yield build(plan)


def _fill(p: PendingParam, out: list[torch.Tensor]) -> None:
    if p.fetch_into is not None:
        p.fetch_into(out)
        return
    got = p.fetch()
    if [n for n, _ in got] != [s.name for s in p.specs]:
        raise ValueError(f"{p.name}: fetch returned {[n for n, _ in got]}, announced {p.specs}")
    for dst, (_, t) in zip(out, got, strict=True):
        dst.copy_(t)

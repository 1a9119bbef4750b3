"""Digests of the weights a round moves: proof that every replica holds the bytes sent.

What is compared, and why: the publisher digests each tensor as it packs it (the bytes it
puts on the wire, named as the trainer names them), and each replica's receiving engine
digests each tensor as it arrives, before loading it, under the same name. The coordinator
compares the two maps when it decides the round (:meth:`rollout.sync.rounds.Rounds.close`):
a replica whose map differs fails the round, named with the tensors that differ, and
every replica keeps the committed version.

The live parameters are not what is digested: vLLM holds them in its runtime layout (q, k
and v fused, gate and up fused, shards per tensor-parallel rank), so a digest of them
(vLLM's ``compute_weight_checksums``, sha256 of each live parameter) can only be compared
between replicas of the same layout, never with what the trainer sent, and it copies
every parameter to the host. Digesting the received bytes compares like with like, costs
one pass over bytes already in host memory (gloo's buckets), and runs while the next
buckets are on the wire. What it cannot see is a load that writes the right bytes to the
wrong place; the greedy-equals-reference tests cover that path.

The digest of a tensor: its bytes read as 64-bit integers, laid out in rows of ``ROW``
(4 KiB), summed modulo 2**64 three ways: the row sums weighted by odd row numbers, the
column sums weighted by odd column numbers, and the tail (the bytes past the last whole
row) weighted by odd byte positions; with the byte length. Odd weights make every change
of a single element change a sum (an even weight would miss a flipped top bit), and the
two weightings catch a swap of two elements in one row or one column (unless equal) and
most others. It is a check against corruption (a
flipped bit, a truncated, shifted or misplaced buffer, a wrong tensor), not against a
forger. The cost decided it: it is two vectorized reductions (numpy in one thread on the
host; torch on a GPU tensor's own device, without copying it to the host), where a hash is
a serial pass; on the
2-core CI machine it ran at about twice zlib's CRC-32 and several times SHA-256's or
BLAKE2b's throughput, and a round's bytes are digested once by the sender and once by
every replica against a wire that moves them at memory speed. The sums wrap the same way
in any order, so the digest does not depend on the device or the reduction order. Only the
combined digest of a round (:func:`combine`, what status shows) is a hash (SHA-256).

The receiving engine runs in vLLM's engine process, whose ``update_weights`` returns
nothing: it writes its digests to a file the agent names in the update info (one per
engine rank, :func:`write_received`), which the agent reads back (:func:`read_received`).
Both are on one host (vLLM's CPU engine core is a child of the replica's process).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

# One tensor's digest, as hex; a round's digests map the trainer's names to them.
TensorDigests = dict[str, str]

# Test hook (inert unless a test creates it): a file of this name in a replica's digest
# directory (:func:`replica_dir`) makes that replica's receiving engine flip one byte of the
# next tensor it receives, as a corrupted transfer would, and delete the file.
CORRUPT_MARKER = "corrupt-next-receive"
# Names of differing tensors an error message lists before "and N more".
NAMED_IN_ERRORS = 8


# 64-bit words per row: 4 KiB. Wider rows make both reductions run nearer memory speed
# (numpy on the 2-core CI machine, one 32 MiB bucket: 17 GB/s at 512 words, 12 GB/s at 64).
ROW = 512
_MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=64)
def _odd(n: int, device: str):
    """1, 3, 5, ... (n of them), as int64 on ``device`` (kept: tensors repeat their sizes)."""
    import torch

    return 2 * torch.arange(n, dtype=torch.int64, device=device) + 1


@functools.lru_cache(maxsize=64)
def _odd_host(n: int):
    """:func:`_odd` as a numpy array, for :func:`_host_sums`."""
    import numpy as np

    return 2 * np.arange(n, dtype=np.int64) + 1


def tensor_digest(tensor) -> str:
    """``"<row sum><column sum><tail sum>:<byte length>"`` (each sum 16 hex digits) of
    ``tensor``'s bytes in row-major order, computed where the tensor is (see above)."""
    return digest_all([("", tensor)])[""]


def _bytes(tensor):
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _format(sums: Sequence[int], nbytes: int) -> str:
    return "".join(f"{v & _MASK:016x}" for v in sums) + f":{nbytes}"


def _device_sums(b):
    """The three sums of the bytes ``b`` (uint8, 1-D), by torch on ``b``'s device, as one
    int64 tensor of three there: not read back, so a caller reads a whole bucket's sums
    with one synchronization instead of three per tensor."""
    import torch

    n = b.numel()
    rows = n // (8 * ROW)
    body = b[: rows * 8 * ROW]
    try:
        words = body.view(torch.int64)
    except RuntimeError:  # not 8-byte aligned (a view after an odd-sized tensor): align a copy
        words = body.clone().view(torch.int64)
    device = str(b.device)
    zero = torch.zeros((), dtype=torch.int64, device=b.device)
    row_sum = column_sum = tail_sum = zero
    if rows:
        grid = words.view(rows, ROW)
        row_sum = (grid.sum(1) * _odd(rows, device)).sum()
        column_sum = (grid.sum(0) * _odd(ROW, device)).sum()
    tail = b[rows * 8 * ROW :]
    if tail.numel():
        tail_sum = (tail.to(torch.int64) * _odd(tail.numel(), device)).sum()
    return torch.stack([row_sum, column_sum, tail_sum])


def _host_sums(b) -> list[int]:
    """:func:`_device_sums` of host bytes ``b`` (a 1-D uint8 numpy array), by numpy: the
    same reductions in one thread, the GIL released."""
    import numpy as np

    n = b.size
    rows = n // (8 * ROW)
    sums = [0, 0, 0]
    if rows:
        words = b[: rows * 8 * ROW].view(np.int64)
        if not words.flags.aligned:  # a view after an odd-sized tensor: align a copy
            words = words.copy()
        grid = words.reshape(rows, ROW)
        sums[0] = int(np.dot(grid.sum(1), _odd_host(rows)))
        sums[1] = int(np.dot(grid.sum(0), _odd_host(ROW)))
    tail = b[rows * 8 * ROW :]
    if tail.size:
        sums[2] = int(np.dot(tail.astype(np.int64), _odd_host(tail.size)))
    return sums


def digest_all(named: Iterable[tuple[str, object]], into: Optional[TensorDigests] = None) -> TensorDigests:
    """``{name: tensor_digest(t)}`` for ``named``, added to ``into`` where given. Host
    tensors are summed by numpy as they come; device tensors on their device, read back
    together at the end (one synchronization for all of them)."""
    out = {} if into is None else into
    on_device: list[tuple[str, int, object]] = []
    for name, t in named:
        b = _bytes(t)
        # A host tensor's sums are numpy's: the same sums (int64 wraps alike), in one thread.
        # torch splits a reduction over its intra-op threads, and on a busy host (a replica's
        # engine beside the trainer's sender and gloo's threads) each reduction then waits for
        # a thread that has no core: on the 2-core CI machine that cost a replica more than
        # the 5% of a publish the digest may take (`make bench`, weight_sync's digest table).
        if b.device.type == "cpu":
            out[name] = _format(_host_sums(b.numpy()), b.numel())
        else:
            on_device.append((name, b.numel(), _device_sums(b)))
    if on_device:
        import torch

        values = torch.stack([sums for _, _, sums in on_device]).tolist()
        for (name, nbytes, _), sums in zip(on_device, values):
            out[name] = _format(sums, nbytes)
    return out


def combine(digests: Mapping[str, str]) -> str:
    """One digest of a set of weights: SHA-256 of every tensor's name and digest, in name
    order (fixed, whatever order a round sent them in: a publish goes in the trainer's
    order, a restore in the checkpoint's), so that two replicas holding the same bytes show
    the same digest and a renamed tensor changes it."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return h.hexdigest()


def differing(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """Names whose digests differ, in ``expected``'s order, then names only ``got`` has."""
    return [n for n in expected if got.get(n) != expected[n]] + [n for n in got if n not in expected]


def describe(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMED_IN_ERRORS])
    more = f" and {len(names) - NAMED_IN_ERRORS} more" if len(names) > NAMED_IN_ERRORS else ""
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} ({shown}{more})"


# ---- from the receiving engine to the agent --------------------------------------------


def replica_dir(replica_id: str) -> Path:
    """Where a replica's engine leaves its digests (and where the test hook's marker goes)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica_id)
    return Path(tempfile.gettempdir()) / "rollout-digests" / safe


def received_path(replica_id: str, round_id: str) -> Optional[str]:
    """The path prefix the agent names in a round's update info (``digest_path``), in a
    directory only this user can enter; None (digests not collected, logged) where that
    directory is not private."""
    try:
        d = _private_dir(replica_dir(replica_id))
    except PermissionError as e:
        logger.error("received-bytes digests are not collected: %s", e)
        return None
    return str(d / round_id)


def _private_dir(path: Path) -> Path:
    """``path`` (and its parent) as directories only this user can write: made 0700 where
    absent; one that another user owns, that others may write, or that is a link is refused.
    In a shared temporary directory another local user must not steer where the engine
    writes, nor plant the test hook's marker."""
    for d in (path.parent, path):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PermissionError(f"{d} is not a private directory of this user (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return path


def _rank_file(path: str, rank: int) -> Path:
    return Path(f"{path}.rank{rank}.json")


@dataclass(frozen=True)
class Received:
    """What a replica's engine received, as its ranks wrote it."""

    digests: TensorDigests
    seconds: float  # spent digesting (the slowest rank), reported as the round's phase "receive.digest"


def write_received(path: str, rank: int, digests: TensorDigests, seconds: float) -> None:
    """The receiving engine's rank ``rank``: its digests, written whole (renamed into place)."""
    final = _rank_file(path, rank)
    tmp = final.with_suffix(".tmp")
    tmp.write_text(json.dumps({"digests": digests, "seconds": seconds}))
    os.replace(tmp, final)


def read_received(path: str) -> Optional[Received]:
    """What every engine rank of a replica wrote under ``path`` (the files are removed);
    None when no rank wrote any (an engine that does not digest). Every rank receives every
    tensor, so they must agree; a rank that differs is an error naming the tensors."""
    files = sorted(Path(path).parent.glob(Path(path).name + ".rank*.json"))
    if not files:
        return None
    ranks = []
    for f in files:
        ranks.append(json.loads(f.read_text()))
        f.unlink(missing_ok=True)
    first = ranks[0]["digests"]
    for f, other in zip(files[1:], ranks[1:]):
        diff = differing(first, other["digests"])
        if diff:
            raise ValueError(f"engine ranks disagree on what they received: {f.name} differs from {files[0].name} in {describe(diff)}")
    return Received(first, max(r["seconds"] for r in ranks))


def take_corruption(path: str) -> bool:
    """Test hook: whether the marker sits beside ``path`` (it is then removed, one-shot)."""
    marker = Path(path).parent / CORRUPT_MARKER
    try:
        marker.unlink()
    except FileNotFoundError:
        return False
    return True


def corrupt(tensor) -> None:
    """Test hook: flip every bit of ``tensor``'s first byte, in place."""
    import torch

    flat = tensor.reshape(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.reshape(-1)
    flat[0] = flat[0] ^ 0xFF

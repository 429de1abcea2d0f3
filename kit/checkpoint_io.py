"""
Checkpoint files on disk: written whole or not at all (`replace_atomically`: temporary file, fsync, rename),
each proving its bytes (a sha256 of every tensor inside every .pt, a SHA256SUMS beside every sharded folder's
files, written last), and read safely (`load_checkpoint`: tensors only, digests checked, every way a file
can be unusable named in one line as a CheckpointError). kit/checkpoint.py decides what a checkpoint holds
and when it is written; this file only writes and reads the bytes.
"""
import hashlib
import os
import pickle
import shutil
import zipfile
from contextlib import suppress

import torch

from kit import runtime

# -----------------------------------------------------------------------------
# writing a file whole or not at all

def replace_atomically(path, write, kept="the previous file there and earlier checkpoints are intact",
                       then="--resume=latest if the run stopped"):
    """write(f) into a temporary file, fsync, rename over the target, fsync the folder: a crash at any
    moment leaves the old file or the new one, never a torn one. A failed write (a full disk, no
    permission) removes the temporary file and names the file, the cause, what is `kept` and the fix, and
    what to do `then` (data.py's files: prepare the data again)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(dir_fd)  # make the rename itself durable
        os.close(dir_fd)
    except (OSError, RuntimeError) as e:  # a full disk shows as either, depending on where the write stops
        with suppress(OSError):  # the half-written file would only take space
            os.remove(tmp)
        folder = os.path.dirname(os.path.abspath(path))
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        if isinstance(e, PermissionError):
            fix = f"make {folder} writable"
        else:
            reason += f"; {shutil.disk_usage(folder).free / 2**20:.1f} MiB free there"
            fix = "free space"
        raise OSError(f"cannot write {path} ({reason}); {kept}: {fix}, then {then}") from e


def write_atomically(path, payload):
    """torch.save of `payload` with its digests (`payload_digests`) beside it, written atomically
    (replace_atomically): the file proves its own bytes wherever it is copied."""
    payload = tree_to_cpu(payload)  # hashed and written from one host copy
    payload = {**payload, DIGESTS: payload_digests(payload)}
    replace_atomically(path, lambda f: torch.save(payload, f))


# -----------------------------------------------------------------------------
# digests: every checkpoint proves its bytes (torch.load checks no checksum of the zip archive's records)

DIGESTS = "sha256"  # a .pt's key of its digests
FOLDER_DIGESTS = "SHA256SUMS"  # a sharded folder's digests of its files, `sha256sum -c` format, written last
EVERYTHING_ELSE = "its configs, counters and structure"  # the digest of a payload's plain values


def tree_to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: tree_to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(tree_to_cpu(v) for v in value)
    return value


def tensor_sha256(t):
    """sha256 of a CPU tensor's dtype, shape and bytes (hashlib reads the buffer in place: no copy)."""
    digest = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def payload_digests(payload):
    """{path: sha256} of every tensor of a checkpoint's payload (its keys joined by "/"), and under
    EVERYTHING_ELSE one of the rest: the repr of the structure with each tensor replaced by its path."""
    tensors = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return f"<tensor {path}>"
        if isinstance(value, dict):
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, f"{path}/{i}") for i, v in enumerate(value))
        return value

    rest = hashlib.sha256(repr(walk(payload, "")).encode()).hexdigest()
    return {**{path: tensor_sha256(t) for path, t in tensors.items()}, EVERYTHING_ELSE: rest}


def file_sha256(path):
    """sha256 of a file, read a MiB at a time (checkpoint folders here; data.py's shards and sources too)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def note_unverified(what):
    runtime.say(f"note: {what} carries no sha256 digests (written before checkpoints had them): its bytes are not checked")


def check_payload(path, state):
    """Removes the digests from a loaded payload and checks them against its contents; a mismatch raises
    CheckpointError naming the file, the tensor, and the digest expected and found."""
    expected = state.pop(DIGESTS, None)
    if expected is None:
        return note_unverified(f"checkpoint {path}")
    found = payload_digests(state)
    if not isinstance(expected, dict):
        expected = {}
    for key in list(expected) + [k for k in found if k not in expected]:
        if expected.get(key) != found.get(key):
            what = f"{key} have" if key == EVERYTHING_ELSE else f"tensor {key} has"
            raise CheckpointError(f"checkpoint {path} is damaged: {what} sha256 {found.get(key, 'none (missing)')}, "
                                  f"expected {expected.get(key, 'none (not written)')}; use another checkpoint "
                                  "(--resume=latest takes the newest intact one)")


def write_folder_digests(folder):
    """FOLDER_DIGESTS of every other file in `folder`, written last: its presence says the rest is complete."""
    names = sorted(n for n in os.listdir(folder) if n != FOLDER_DIGESTS)
    text = "".join(f"{file_sha256(os.path.join(folder, n))}  {n}\n" for n in names)
    replace_atomically(os.path.join(folder, FOLDER_DIGESTS), lambda f: f.write(text.encode()))


def check_folder(folder):
    """Every file a sharded checkpoint's FOLDER_DIGESTS lists is there with its sha256; raises CheckpointError
    naming the first that is not."""
    listing = os.path.join(folder, FOLDER_DIGESTS)
    if not os.path.exists(listing):
        return note_unverified(f"sharded checkpoint {folder}")
    with open(listing, "rb") as f:
        lines = f.read().decode("utf-8", "replace").splitlines()
    expected = dict(reversed(line.split("  ", 1)) for line in lines if "  " in line)
    if not expected or len(expected) != len(lines):
        raise CheckpointError(f"sharded checkpoint {folder} is damaged: its {FOLDER_DIGESTS} is not a list of digests; "
                              "use another checkpoint (--resume=latest takes the newest intact one)")
    for name, want in expected.items():
        file = os.path.join(folder, name)
        got = file_sha256(file) if os.path.isfile(file) else "none (the file is missing)"
        if got != want:
            raise CheckpointError(f"sharded checkpoint {folder} is damaged: {name} has sha256 {got}, expected {want}; "
                                  "use another checkpoint (--resume=latest takes the newest intact one)")


def digest_status(path):
    """Whether a checkpoint's bytes still match the sha256 digests written with them: "intact", "not recorded"
    (written before checkpoints had digests) or "damaged: ..." naming what differs. Reads every byte."""
    try:
        if os.path.isdir(path):
            if not os.path.exists(os.path.join(path, FOLDER_DIGESTS)):
                return "not recorded"
            check_folder(path)  # meta.pt and the shards, each file against its listed sha256
            return "intact"
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if DIGESTS not in state:
            return "not recorded"
        check_payload(path, state)
        return "intact"
    except CheckpointError as e:
        return f"damaged: {e}"
    except RuntimeError as e:  # the zip reader's: a damaged archive
        return f"damaged: {str(e).splitlines()[0]}"


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint; the message names it and says why."""


RUN_KEYS = ("step", "train_time", "loader", "rng", "train_config", "model_config")
CHECKPOINT_KEYS = ("model", "optimizers") + RUN_KEYS


def load_checkpoint(path, keys=CHECKPOINT_KEYS, mmap=False, verify=True):
    """Tensors and plain containers only (weights_only=True): a checkpoint file can never run code. Every way a
    file can be unusable (empty, cut short, not a checkpoint, a pickled object, keys missing, bytes that no
    longer match their digests) raises CheckpointError naming it; torch's own advice for some of these
    (weights_only=False) would be unsafe. verify: check the digests (`check_payload`, `check_folder`); a
    checkpoint written before they existed loads with a note. Tensors load on the CPU; mmap: map them
    instead of reading them. A sharded checkpoint's folder gives its meta.pt, and "folder", its path, for
    `restore` to read the tensors from. (torch.distributed.checkpoint reads the folder's .metadata with
    pickle, torch/distributed/checkpoint/filesystem.py: resume only from folders you wrote.)"""
    if str(path).endswith(".dcp") and os.path.isdir(path):
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise CheckpointError(f"sharded checkpoint {path} lacks its .metadata: it was not completely written; "
                                  "use another checkpoint")
        if verify:
            check_folder(path)
        return {**load_checkpoint(os.path.join(path, "meta.pt"), RUN_KEYS, mmap, verify=False), "folder": path}
    size = os.path.getsize(path)  # a missing file raises FileNotFoundError, which names it
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): it was never written; use another checkpoint")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive whose directory is at its end
        raise CheckpointError(f"checkpoint {path} ({size:,} bytes) is not a PyTorch checkpoint: truncated, or another "
                              "kind of file; use another checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # torch's message advises weights_only=False: not for a file like this
        what = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "unknown content")
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers, refused "
                              f"unloaded ({what}); only load files you trust") from e
    except RuntimeError as e:  # the zip reader's errors: a damaged archive whose directory survived
        raise CheckpointError(f"checkpoint {path} is damaged ({str(e).splitlines()[0]}); use another checkpoint") from e
    if verify and isinstance(state, dict):
        check_payload(path, state)
    elif isinstance(state, dict):
        state.pop(DIGESTS, None)
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if "optimizers" in missing and isinstance(state, dict) and {"model", "model_config"} <= state.keys():
        raise CheckpointError(f"checkpoint {path} holds the weights only (a final.pt, for evaluation); resume from "
                              "a ckpt_*.pt (written with --checkpoint_every or by a stop signal)")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: it was not written by this train.py")
    return state

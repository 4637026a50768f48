"""The Hugging Face tensors an import reads for the tensors of ours that an adapter derives from
them (models.spec.Derived: gpt-oss's w1 and w3 are the even and odd columns of `gate_up_proj`),
and MXFP4 pairs (`X_blocks` + `X_scales`) read as the tensor X they encode (checkpoint/mxfp4.py),
wherever a derived tensor names X as a source.

HFReader (checkpoint/hf.py) gives each tensor of the folder that is wanted here (`wants`,
`take`), then adds the derived tensors' metadata (`resolve`) and reads them (`read`). A derived
tensor whose rows are its sources' rows (`by_row`: stacked experts) is read one row (expert) at a
time, only the rows of the rank's slice, so an import of gpt-oss-120b decodes one expert's
MXFP4 weight at a time (about 66 MB in fp32); any other is computed from whole sources and cut.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from torchtitan_amp.checkpoint import mxfp4
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.spec import Derived

_SUFFIXES = (mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX)
Seen = tuple[str, torch.Size, torch.dtype]  # (file, shape, dtype)


class DerivedSources:
    """The sources found in a folder for an adapter's derived tensors."""

    def __init__(self, folder: Path, derived: dict[str, Derived]) -> None:
        self.folder, self.derived = folder, derived
        self.names = {n for d in derived.values() for n in d.sources}
        self.plain: dict[str, Seen] = {}
        self.packed: dict[str, dict[str, Seen]] = {}  # X -> {"_blocks": ..., "_scales": ...}

    def wants(self, name: str) -> bool:
        """Whether a derived tensor reads `name` (itself, or as half of an MXFP4 pair)."""
        return name in self.names or (name[-7:] in _SUFFIXES and name[:-7] in self.names)

    def take(self, name: str, path: Path, shape: list[int], dtype: torch.dtype) -> None:
        """Record where a wanted tensor is.

        Args:
            name: its name in the folder.
            path: the safetensors file holding it.
            shape: its shape there.
            dtype: its dtype there.
        """
        seen = (str(path), torch.Size(shape), dtype)
        if name in self.names:
            self.plain[name] = seen
        else:
            self.packed.setdefault(name[:-7], {})[name[-7:]] = seen

    def _source_meta(self, name: str) -> torch.Tensor | None:
        """A meta tensor of the source's shape and dtype as read (MXFP4: decoded, fp32)."""
        if name in self.plain:
            _, shape, dtype = self.plain[name]
            return torch.empty(shape, dtype=dtype, device="meta")
        parts = self.packed.get(name)
        if parts is None:
            return None
        if len(parts) < 2:
            missing = next(s for s in _SUFFIXES if s not in parts)
            raise CheckpointError(f"{self.folder} has MXFP4 tensor '{name}' without its '{name}{missing}'")
        (_, bshape, bdtype), (_, sshape, sdtype) = parts[mxfp4.BLOCKS_SUFFIX], parts[mxfp4.SCALES_SUFFIX]
        blocks = torch.empty(bshape, dtype=bdtype, device="meta")
        mxfp4.check_shapes(name, blocks, torch.empty(sshape, dtype=sdtype, device="meta"), None)
        rows, cols = bshape[-3], bshape[-2] * mxfp4.MX_BLOCK
        return torch.empty((*bshape[:-3], cols, rows), dtype=torch.float32, device="meta")

    def resolve(self) -> dict[str, tuple[torch.Size, torch.dtype, str]]:
        """Our FQN -> (shape, dtype, a file of its sources) for each derived tensor whose sources are
        all in the folder; one whose sources are partly there is refused in one line."""
        out = {}
        for fqn, how in self.derived.items():
            metas = {n: self._source_meta(n) for n in how.sources}
            found = [n for n, m in metas.items() if m is not None]
            if not found:
                continue  # the model-fits check names the missing tensor
            if len(found) < len(metas):
                missing = next(n for n, m in metas.items() if m is None)
                raise CheckpointError(f"{self.folder} has no tensor '{missing}' (a source of '{fqn}')")
            try:
                result = how.compute({n: m for n, m in metas.items() if m is not None})
            except (RuntimeError, IndexError, ValueError) as e:
                raise CheckpointError(f"{self.folder}: the sources of '{fqn}' do not fit ({e})") from None
            first = found[0]
            path = self.plain[first][0] if first in self.plain else self.packed[first][mxfp4.BLOCKS_SUFFIX][0]
            out[fqn] = (result.shape, result.dtype, path)
        return out

    def read(self, fqn: str, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """Our slice of a derived tensor: its rows of the sources, one row at a time (by_row), or the
        whole sources.

        Args:
            fqn: our tensor's FQN (a key of the adapter's derived tensors).
            offsets: the slice's start in each dim.
            lengths: its length in each dim.
        """
        from safetensors import safe_open

        how = self.derived[fqn]
        rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
        with contextlib.ExitStack() as stack:
            files: dict[str, Any] = {}

            def _get(path: str, name: str, rows: slice) -> torch.Tensor:
                if path not in files:
                    files[path] = stack.enter_context(safe_open(path, framework="pt"))
                return files[path].get_slice(name)[rows]

            def sources(rows: slice) -> dict[str, torch.Tensor]:
                values = {}
                for name in how.sources:
                    if name in self.plain:
                        values[name] = _get(self.plain[name][0], name, rows)
                    else:
                        parts = self.packed[name]
                        blocks, scales = (_get(parts[s][0], name + s, rows) for s in _SUFFIXES)
                        values[name] = mxfp4.dequantize(name, blocks, scales)
                return values

            if how.by_row:  # only this slice's rows, one at a time
                rows = range(offsets[0], offsets[0] + lengths[0])
                return torch.cat([how.compute(sources(slice(r, r + 1)))[(slice(None),) + rest] for r in rows])
            full = how.compute(sources(slice(None)))
            return full[(slice(offsets[0], offsets[0] + lengths[0]),) + rest]

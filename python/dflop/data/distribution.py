"""ShapeDistribution: the sample shapes of a dataset, with where they came from.

The data profiler (:func:`dflop.data.profiler.profile_dataset`) produces one; the planner
draws batches from it (:meth:`ShapeDistribution.sample`) to simulate training steps.
:meth:`ShapeDistribution.from_synthetic` gives the embedded LLaVA-OneVision-like default
when there is no dataset at hand.

File format (version 1)
-----------------------
JSON (any path not ending with ``.parquet``)::

    {"format": "dflop.shape_distribution", "version": 1, "family": "llava-ov",
     "num_samples": N, "meta": {...}, "columns": {"encoder_units": [...], ...}}

Parquet (``.parquet``, needs ``pyarrow``): one row per sample with the columns
``encoder_units``, ``tokens_per_unit``, ``llm_visual_tokens``, ``text_tokens`` (int64) and
``modality`` (int8), and ``target_tokens`` (int64); everything else (format, version, family, meta) is JSON in the schema
metadata under the key ``dflop.shape_distribution``.

``meta`` holds: ``source`` (what was profiled), ``num_read`` (samples read, profiled or
skipped), ``skipped`` (count per reason), ``skipped_examples`` (the first few skipped
samples per reason: reason, file, index, message), ``sources`` (per dataset file: path,
sampling strategy, samples read/profiled/skipped), ``text_tokens_method`` and ``extra``
(free-form). Readers reject files of a newer version.

``target_tokens`` (each sample's loss tokens) was added to version 1 later: a file without
it loads with the documented estimate (:data:`dflop.data.shapes.TARGET_SHARE_ESTIMATE`),
and says so (``SampleShapes.targets_estimated``, the summary's line "target tokens:
estimated"); profile the dataset again to count them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflop.data.families import FamilySpec, get_family
from dflop.data.shapes import Modality, SampleShapes
from dflop.errors import InputTypeError
from dflop.safe_io import check_regular_file, load_json, loads_json, open_regular

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "ShapeDistribution"]

FORMAT_NAME = "dflop.shape_distribution"
FORMAT_VERSION = 1
_COLUMNS = ("encoder_units", "tokens_per_unit", "llm_visual_tokens", "text_tokens", "modality")
_OPTIONAL_COLUMNS = ("target_tokens",)
_QUANTILES = (0.0, 0.10, 0.50, 0.90, 0.99, 1.0)


@dataclass
class ShapeDistribution:
    """Shapes of the samples of a dataset plus what was read and skipped.

    Attributes:
        samples: the profiled samples' shapes.
        family: name of the model family whose rules produced the shapes.
        source: what was profiled (dataset path, or ``"synthetic(...)"``).
        num_read: samples read (profiled + skipped); ``len(samples)`` when None.
        skipped: number of skipped samples per reason (e.g. ``"missing_image"``).
        skipped_examples: the first few skipped samples per reason, each a dict with
            ``reason``, ``file``, ``index`` and ``message``.
        sources: per dataset file: ``path``, ``sampling_strategy``, ``num_read``,
            ``num_profiled``, ``num_skipped``.
        text_tokens_method: how text tokens were counted (``"estimate:chars/4"``,
            ``"tokenizer:<name>"``, ``"synthetic"``).
        extra: free-form metadata (JSON-serialisable), e.g. the seed.
    """

    samples: SampleShapes
    family: str
    source: str = ""
    num_read: int | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: list[dict[str, Any]] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)
    text_tokens_method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.samples, SampleShapes):
            raise InputTypeError(
                f"ShapeDistribution.samples must be a SampleShapes, got "
                f"{type(self.samples).__name__}"
            )
        if self.num_read is None:
            self.num_read = len(self.samples) + self.num_skipped

    # ----------------------------------------------------------------- basics

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_samples(self) -> int:
        """Number of profiled samples."""
        return len(self.samples)

    @property
    def num_skipped(self) -> int:
        """Number of samples read but skipped (all reasons)."""
        return int(sum(self.skipped.values()))

    @property
    def spec(self) -> FamilySpec:
        """The :class:`FamilySpec` of :attr:`family` (raises for unknown names)."""
        return get_family(self.family)

    def modality_counts(self) -> dict[str, int]:
        """Profiled samples per modality name (all four names present)."""
        counts = np.bincount(self.samples.modality.astype(np.int64), minlength=4)
        return {name: int(counts[code]) for code, name in enumerate(Modality.NAMES)}

    @classmethod
    def from_synthetic(
        cls, num_samples: int = 100_000, seed: int = 0, family: str | FamilySpec = "llava-ov"
    ) -> ShapeDistribution:
        """The embedded synthetic distribution (:func:`dflop.data.synthetic.synthetic_shapes`,
        mirroring the LLaVA-OneVision data mix)."""
        from dflop.data.synthetic import synthetic_shapes

        spec = get_family(family)
        shapes = synthetic_shapes(num_samples, seed=seed, family=spec)
        return cls(
            samples=shapes,
            family=spec.name,
            source=f"synthetic(num_samples={int(num_samples)}, seed={int(seed)})",
            text_tokens_method="synthetic",
            extra={"seed": int(seed)},
        )

    def sample(self, num_samples: int, seed: int = 0) -> SampleShapes:
        """``num_samples`` shapes drawn uniformly with replacement (bootstrap); the same
        seed gives the same draw.

        Raises:
            ValueError: the distribution is empty, or ``num_samples < 0``.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)):
            raise InputTypeError(f"num_samples must be an int, got {type(num_samples).__name__}")
        if num_samples < 0:
            raise ValueError(f"num_samples={num_samples} must be >= 0")
        if len(self.samples) == 0:
            raise ValueError(f"cannot sample from an empty ShapeDistribution ({self.source})")
        rng = np.random.default_rng(int(seed))
        return self.samples.take(rng.integers(0, len(self.samples), size=int(num_samples)))

    # ----------------------------------------------------------------- I/O

    def _meta(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_read": int(self.num_read or 0),
            "skipped": {k: int(v) for k, v in self.skipped.items()},
            "skipped_examples": self.skipped_examples,
            "sources": self.sources,
            "text_tokens_method": self.text_tokens_method,
            "extra": self.extra,
        }

    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "family": self.family,
            "num_samples": len(self.samples),
            "meta": self._meta(),
        }

    def _saved(self) -> tuple[str, ...]:
        """The columns written: an estimate of the targets is not saved as a count."""
        return _COLUMNS if self.samples.targets_estimated else _COLUMNS + _OPTIONAL_COLUMNS

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path``: Parquet when it ends with ``.parquet``, else JSON."""
        path = os.fspath(path)
        if path.lower().endswith(".parquet"):
            pa, pq = _pyarrow(path)
            table = pa.table(
                {name: np.asarray(getattr(self.samples, name)) for name in self._saved()}
            )
            table = table.replace_schema_metadata(
                {FORMAT_NAME: json.dumps(self._header(), sort_keys=True)}
            )
            pq.write_table(table, path)
            return
        doc = self._header()
        doc["columns"] = {name: getattr(self.samples, name).tolist() for name in self._saved()}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShapeDistribution:
        """Read a file written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a shape distribution, a newer format version, or corrupt
                columns (the message names the file and the field).
            ImportError: a ``.parquet`` path without ``pyarrow`` installed.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"shape distribution file {path!r} does not exist")
        check_regular_file(path, "shape distribution file")  # a named pipe blocks open()
        if path.lower().endswith(".parquet"):
            pa, pq = _pyarrow(path)
            try:
                table = pq.read_table(path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise ValueError(f"{path}: not a readable Parquet file: {exc}") from None
            raw = (table.schema.metadata or {}).get(FORMAT_NAME.encode())
            if raw is None:
                raise ValueError(
                    f"{path}: not a dflop shape distribution (no {FORMAT_NAME!r} metadata)"
                )
            try:
                header = loads_json(raw)
            except ValueError as exc:
                raise ValueError(f"{path}: unreadable {FORMAT_NAME!r} metadata: {exc}") from None
            missing = [c for c in _COLUMNS if c not in table.column_names]
            if missing:
                raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
            columns = {
                c: table.column(c).to_numpy()
                for c in _COLUMNS + _OPTIONAL_COLUMNS
                if c in table.column_names
            }
        else:
            try:
                with open_regular(path, "r", "shape distribution file") as f:
                    header = load_json(f)  # nested too deeply: a ValueError
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: not a JSON shape distribution: {exc}") from None
            if not isinstance(header, dict):
                raise ValueError(f"{path}: not a dflop shape distribution (not a JSON object)")
            columns = header.get("columns")
        return cls._from_parts(path, header, columns)

    @classmethod
    def _from_parts(cls, path: str, header: dict[str, Any], columns: Any) -> ShapeDistribution:
        if header.get("format") != FORMAT_NAME:
            raise ValueError(
                f"{path}: not a dflop shape distribution (format={header.get('format')!r}, "
                f"expected {FORMAT_NAME!r})"
            )
        version = header.get("version")
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"{path}: invalid format version {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{path}: format version {version} is newer than this dflop supports "
                f"({FORMAT_VERSION}); upgrade dflop"
            )
        if not isinstance(columns, dict):
            raise ValueError(f"{path}: missing 'columns'")
        arrays = {}
        for name in _COLUMNS + _OPTIONAL_COLUMNS:
            if name not in columns:
                if name in _OPTIONAL_COLUMNS:
                    continue
                raise ValueError(f"{path}: missing column {name!r}")
            arr = np.asarray(columns[name])
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"{path}: column {name!r} must be a list of integers")
            arrays[name] = arr.astype(np.int8 if name == "modality" else np.int64)
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1:
            raise ValueError(f"{path}: columns have different lengths {sorted(lengths)}")
        n = lengths.pop()
        if header.get("num_samples", n) != n:
            raise ValueError(
                f"{path}: num_samples={header.get('num_samples')} but columns hold {n} rows"
            )
        meta = header.get("meta") or {}
        family = header.get("family")
        if not isinstance(family, str):
            raise ValueError(f"{path}: missing 'family'")
        try:
            samples = SampleShapes(**arrays)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return cls(
            samples=samples,
            family=family,
            source=str(meta.get("source", "")),
            num_read=meta.get("num_read"),
            skipped={str(k): int(v) for k, v in (meta.get("skipped") or {}).items()},
            skipped_examples=list(meta.get("skipped_examples") or []),
            sources=list(meta.get("sources") or []),
            text_tokens_method=str(meta.get("text_tokens_method", "")),
            extra=dict(meta.get("extra") or {}),
        )

    # ----------------------------------------------------------------- summaries

    def summary(self, *, num_bins: int = 10, bar_width: int = 40) -> str:
        """A text summary: counts per modality, skipped samples, quantiles and text
        histograms of encoder units (samples with visual input) and LLM sequence lengths."""
        s = self.samples
        lines = [
            f"ShapeDistribution: {len(s):,} samples, family {self.family}",
            f"  source: {self.source or '(unknown)'}",
        ]
        if self.text_tokens_method:
            lines.append(f"  text tokens: {self.text_tokens_method}")
        if len(s):
            share = s.target_tokens.sum() / max(int(s.seq_len.sum()), 1)
            how = (
                "estimated (this profile predates target counts: profile the data again)"
                if s.targets_estimated
                else "counted from the answer turns"
            )
            lines.append(f"  target tokens: {how}; {share:.1%} of all LLM tokens")
        lines.append(f"  read {self.num_read:,}, profiled {len(s):,}, skipped {self.num_skipped:,}")
        for reason, count in sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"    {reason}: {count:,}")
            shown: set[tuple[Any, Any]] = set()
            for ex in self.skipped_examples:
                key = (ex.get("file"), ex.get("index"))
                if ex.get("reason") != reason or key in shown or len(shown) >= 3:
                    continue
                shown.add(key)
                lines.append(
                    f"      e.g. {ex.get('file')}: sample {ex.get('index')}: {ex.get('message')}"
                )
        if len(self.sources) > 1:
            lines.append("  files:")
            for src in self.sources:
                lines.append(
                    f"    {src.get('path')} [{src.get('sampling_strategy')}]: read "
                    f"{src.get('num_read', 0):,}, profiled {src.get('num_profiled', 0):,}, "
                    f"skipped {src.get('num_skipped', 0):,}"
                )
        lines.append("")
        lines.append(
            f"  {'modality':<12} {'samples':>9} {'share':>7} {'units':>8} {'vis_tok':>9} "
            f"{'text_tok':>9} {'seq_len':>9}   (means)"
        )
        seq = s.seq_len
        for code, name in enumerate(Modality.NAMES):
            sel = s.modality == code
            k = int(sel.sum())
            if k == 0:
                lines.append(f"  {name:<12} {0:>9} {0:>6.1%}")
                continue
            lines.append(
                f"  {name:<12} {k:>9,} {k / len(s):>6.1%} {s.encoder_units[sel].mean():>8.1f} "
                f"{s.llm_visual_tokens[sel].mean():>9.1f} {s.text_tokens[sel].mean():>9.1f} "
                f"{seq[sel].mean():>9.1f}"
            )
        visual = s.encoder_units[s.encoder_units > 0]
        lines.append("")
        lines.extend(
            _describe(
                "encoder units per sample (samples with visual input)", visual, num_bins, bar_width
            )
        )
        lines.append("")
        lines.extend(_describe("LLM sequence length (tokens)", seq, num_bins, bar_width))
        return "\n".join(lines)

    def plot(self, path_png: str | os.PathLike[str]) -> None:
        """Write a PNG with histograms of encoder units and of LLM sequence lengths,
        stacked per modality (matplotlib, imported lazily; Agg backend)."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"ShapeDistribution.plot({os.fspath(path_png)!r}) needs matplotlib; "
                "install it or use summary() for text histograms"
            ) from exc
        s = self.samples
        seq = s.seq_len
        fig, (ax_u, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
        try:
            for ax, values, title, skip_text in (
                (ax_u, s.encoder_units, "encoder units per sample (visual samples)", True),
                (ax_s, seq, "LLM sequence length (tokens)", False),
            ):
                data, labels, colors = [], [], []
                for code, name in enumerate(Modality.NAMES):
                    if skip_text and code == Modality.TEXT:
                        continue
                    sel = values[s.modality == code]
                    if sel.size:
                        data.append(sel)
                        labels.append(f"{name} ({sel.size:,})")
                        colors.append(f"C{code}")  # one colour per modality in both panels
                if data:
                    every = np.concatenate(data)
                    bins = _edges(every, 40)
                    ax.hist(data, bins=bins, stacked=True, label=labels, color=colors)
                    ax.legend(fontsize=8)
                ax.set_title(title, fontsize=10)
                ax.set_ylabel("samples")
            ax_u.set_xlabel("encoder units (tiles / frames)")
            ax_s.set_xlabel("tokens")
            fig.suptitle(f"{self.family}: {len(s):,} samples from {self.source}", fontsize=10)
            fig.tight_layout()
            fig.savefig(os.fspath(path_png), dpi=100)
        finally:
            plt.close(fig)


# --------------------------------------------------------------------------- helpers


def _pyarrow(path: str) -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"{path}: reading/writing Parquet needs the 'pyarrow' package; install it or "
            "use a .json path"
        ) from exc
    return pa, pq


def _edges(values: np.ndarray, num_bins: int) -> np.ndarray:
    """Histogram bin edges: one bin per integer when the range is small, else
    ``num_bins`` equal bins with integer edges."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo + 1 <= num_bins:
        return np.arange(lo, hi + 2, dtype=np.float64)
    step = math.ceil((hi - lo + 1) / num_bins)
    count = math.ceil((hi - lo + 1) / step)
    return lo + step * np.arange(count + 1, dtype=np.float64)


def _describe(title: str, values: np.ndarray, num_bins: int, bar_width: int) -> list[str]:
    lines = [f"  {title}:"]
    if values.size == 0:
        lines.append("    (none)")
        return lines
    q = np.quantile(values, _QUANTILES)
    names = ("min", "p10", "p50", "p90", "p99", "max")
    lines.append(
        "    "
        + "  ".join(f"{n}={v:,.0f}" for n, v in zip(names, q))
        + f"  mean={values.mean():,.1f}"
    )
    edges = _edges(values, num_bins)
    counts, _ = np.histogram(values, bins=edges)
    peak = max(int(counts.max()), 1)
    width = len(f"{int(edges[-1]):,}")
    for k, c in enumerate(counts):
        lo, hi = int(edges[k]), int(edges[k + 1]) - 1
        label = f"{lo:>{width},}" if lo == hi else f"{lo:>{width},}-{hi:<{width},}"
        bar = "#" * round(bar_width * int(c) / peak)
        if c and not bar:
            bar = "."
        lines.append(
            f"    {label:>{2 * width + 1}} |{bar:<{bar_width}} {int(c):,} ({c / values.size:.1%})"
        )
    return lines

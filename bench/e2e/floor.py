"""The byte floor of the Zipf-over-base saturation ratio: a Zipf step reads, beyond a base step, the
weights of each distinct adapter its batch holds, at least once. With n sequences a step drawn
Zipf(α) over N adapters, the expected number of distinct ones is Σ_k 1 - (1 - p_k)^n; their bytes
over the measured copy bandwidth, added to the base step, bound the ratio from above (tenant-grouped
admission, which lowers the distinct count, could beat it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterFloor:
    seqs_per_step: float  # the Zipf calibration's mean batch
    distinct_adapters: float  # expected distinct adapters in a batch of that size
    adapter_mb: float  # one adapter's weights
    read_ms: float  # the distinct adapters' weights read once at the copy bandwidth
    base_step_ms: float  # the base calibration's mean step

    @property
    def ratio(self) -> float:
        """The most Zipf throughput can keep of base throughput: base step / (base step + reads)."""
        return self.base_step_ms / (self.base_step_ms + self.read_ms)

    def describe(self) -> str:
        return (
            f"byte floor {self.ratio:.2f}× ({self.distinct_adapters:.0f} distinct adapters of "
            f"{self.adapter_mb:.0f} MB in a batch of {self.seqs_per_step:.0f}: {self.read_ms:.2f} ms of reads "
            f"on a {self.base_step_ms:.1f} ms base step)"
        )


def expected_distinct(weights: list[float], draws: float) -> float:
    """Expected number of distinct outcomes in `draws` independent draws with these probabilities."""
    return sum(1.0 - (1.0 - p) ** draws for p in weights)


def adapter_floor(
    weights: list[float], seqs_per_step: float, adapter_bytes: int, bandwidth: float, base_step_ms: float
) -> AdapterFloor:
    """weights: the Zipf probabilities of the adapters; bandwidth in bytes/s."""
    distinct = expected_distinct(weights, seqs_per_step)
    return AdapterFloor(
        seqs_per_step=seqs_per_step,
        distinct_adapters=distinct,
        adapter_mb=adapter_bytes / 1e6,
        read_ms=distinct * adapter_bytes / bandwidth * 1e3,
        base_step_ms=base_step_ms,
    )

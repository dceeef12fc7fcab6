"""Tuning the multi-LoRA plans (kernels/lora/configs.py) for the GPU at hand, in the installed
package so that a worker can tune the models it serves (worker/kernel_plans.py), as `lorafleet
tune` and bench/tune_lora.py do by hand.

    layer.py       a random layer of given projection shapes, its adapters paged as the engine pages them
    timing.py      CUDA-graph medians, L2-flushed kernel timings, the layer as the decoder calls it
    candidates.py  the launch configurations and paths worth timing per token count
    tuner.py       LayerTuner: step 1 per kernel, step 2 per layer path choice, one token bucket at a time
    table.py       merging tuned plans into a GPU's plan file

The caller gives the shapes (LayerShapes: K and slice widths per projection, the page rank, whether
q/k norms exist); nothing here knows a model.
"""

from kernels.lora.tuning.layer import LayerShapes, ProjectionShape
from kernels.lora.tuning.table import update_plan_file
from kernels.lora.tuning.tuner import BucketResult, Echo, LayerTuner, TuneDeadline, served_adapters, silent

__all__ = [
    "BucketResult",
    "Echo",
    "LayerShapes",
    "LayerTuner",
    "ProjectionShape",
    "TuneDeadline",
    "served_adapters",
    "silent",
    "update_plan_file",
]

"""parallel/planning/partition.py's `uniform_bounds` and `balanced_bounds` give DeepSpeed 0.19.8's
`partition_uniform` and `partition_balanced` boundaries: on seeded random weights (zeros, ties, and sums past
2**53 where float rounding decides ties), and through `partition_layers` on the layers of every conf/model preset
for each method `PipelineModule` offers (uniform, parameters, type:REGEX). In-process, pure."""

import random
from pathlib import Path

import pytest
import yaml
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from model import GPTConfig, gpt_layers, layer_param_counts
from parallel.planning.partition import balanced_bounds, partition_layers, uniform_bounds

PRESETS = Path(__file__).resolve().parents[1] / "conf" / "model"
PARTS = range(1, 17)


def theirs(weights: list[int], parts: int) -> list[int]:
    return [int(bound) for bound in partition_balanced(weights=weights, num_parts=parts)]


def random_weights(rng: random.Random, length: int, kind: str) -> list[int]:
    if kind == "small":  # many zeros and ties
        return [rng.choice((0, 0, 1, 1, 2, 3)) for _ in range(length)]
    if kind == "huge":  # past 2**53 DeepSpeed's float prefix sums round: exact sums would pick another split in 1 of 4
        return [rng.choice((0, 2**53, 2**53 + rng.randrange(1, 8))) for _ in range(length)]
    return [rng.randrange(10**6) for _ in range(length)]


def test_uniform_bounds_are_deepspeeds():
    for items in range(0, 201):
        for parts in PARTS:
            assert uniform_bounds(items, parts) == list(partition_uniform(num_items=items, num_parts=parts))


@pytest.mark.parametrize("kind", ["small", "huge", "spread"])
def test_balanced_bounds_are_deepspeeds_on_random_weights(kind):
    rng = random.Random(f"partition-{kind}")
    cases = [(length, parts) for length in range(1, 41) for parts in (1, 2, 3, 4, 7, 16)]
    cases += [(64, 2), (120, 8), (200, 16)]  # DeepSpeed takes 0.3 s of CPU for the last
    for length, parts in cases:
        weights = random_weights(rng, length, kind)
        assert balanced_bounds(weights, parts) == theirs(weights, parts), (weights, parts)


def preset_layers(name: str):
    return gpt_layers(GPTConfig(**yaml.safe_load((PRESETS / f"{name}.yaml").read_text())), seed=0)


@pytest.mark.parametrize("preset", sorted(path.stem for path in PRESETS.glob("*.yaml")))
def test_the_uniform_and_parameters_methods_on_every_model_preset_are_deepspeeds(preset):
    recipes = preset_layers(preset)
    counts = layer_param_counts(recipes)
    for parts in PARTS:
        for method, bounds in (
            ("uniform", list(partition_uniform(num_items=len(recipes), num_parts=parts))),
            ("parameters", theirs(counts, parts)),
        ):
            stages = partition_layers(recipes, parts, method)
            assert [stage.start for stage in stages] + [stages[-1].stop] == bounds, (method, parts)


def test_the_type_method_weighs_the_layers_whose_class_matches_as_deepspeed_does():
    recipes = preset_layers("gpt2")
    matching = [1 if recipe.module_class.__name__ in ("Block", "FinalNorm") else 0 for recipe in recipes]
    for parts in PARTS:
        stages = partition_layers(recipes, parts, "type:block|finalnorm")
        assert [stage.start for stage in stages] + [stages[-1].stop] == theirs(matching, parts), parts

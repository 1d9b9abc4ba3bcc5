"""parallel/runtime/pipeline.py's check that each rank built exactly the layers its plan names, and that DeepSpeed's
partition is the plan's. The check is a function of (what was built, what was planned); every launch runs it on
a real RecomputingPipelineModule (which needs a process group per stage), these tests feed it mismatches."""

import pytest

from model import GPTConfig, gpt_layers
from parallel.planning.partition import stages_of_block_counts
from parallel.runtime.pipeline import BuiltLayer, check_built_as_planned

RECIPES = gpt_layers(GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64), seed=0)
STAGES = stages_of_block_counts(RECIPES, [2, 2])  # [embeddings, 2 blocks] [2 blocks, final norm, LM head]
PARTS = [0, 4, 8]


def built(indices) -> list[BuiltLayer]:
    return [BuiltLayer.planned(RECIPES, i) for i in indices]


def test_stages_built_as_planned_pass():
    assert [(s.start, s.stop) for s in STAGES] == [(0, 4), (4, 8)]
    for stage in STAGES:
        check_built_as_planned(built(stage.layers), PARTS, STAGES, RECIPES, stage.stage)


def test_a_partition_other_than_the_plans_is_refused():
    with pytest.raises(RuntimeError, match=r"DeepSpeed partitioned \[0, 3, 8\], the plan assumed \[0, 4, 8\]"):
        check_built_as_planned(built(range(0, 3)), [0, 3, 8], STAGES, RECIPES, 0)


HEAD = BuiltLayer.planned(RECIPES, 7)
WRONG = {
    "one layer late": built(range(5, 8)) + [BuiltLayer(8, HEAD.module_class, HEAD.forward_fn)],
    "a layer short": built(range(4, 7)),
    "another class": built(range(4, 6)) + [BuiltLayer(6, RECIPES[4].module_class, None), HEAD],
    "the tied embedding without the head's function": built(range(4, 7)) + [BuiltLayer(7, HEAD.module_class, None)],
}


@pytest.mark.parametrize("layers", WRONG.values(), ids=WRONG.keys())
def test_a_stage_that_built_other_layers_than_its_plan_names_is_refused(layers):
    planned = r"its plan names \[4:Block, 5:Block, 6:FinalNorm, 7:final_hidden\]"
    with pytest.raises(RuntimeError, match=r"stage 1 built layers \[.*\], " + planned):
        check_built_as_planned(layers, PARTS, STAGES, RECIPES, 1)

"""Which waiting prompts join the prefill on a CPU (``serving/batch.py``:
``prompts_within``): while the next step, padded to its longest chunk,
holds at most a step's tokens."""

from mlx_lm_server.serving.batch import prompts_within


def test_short_prompts_go_together_until_the_step_is_full():
    admit = prompts_within(512, 512)
    assert admit([], [60] * 16) == 8  # 8 x 60 = 480 tokens; a ninth would pad to 540
    assert admit([60], [60] * 10) == 7


def test_a_long_prompt_goes_alone_and_nothing_joins_it():
    admit = prompts_within(512, 512)
    assert admit([], [1800, 1500, 1600]) == 1
    assert admit([1800], [60]) == 0  # a chunk of 512 padded twice is past the step
    assert admit([300], [100]) == 0  # 2 x 300 = 600 > 512
    assert admit([200], [100]) == 1  # 2 x 200 = 400


def test_one_prompt_at_least_when_nothing_is_prefilling():
    assert prompts_within(512, 256)([], [2000]) == 1
    assert prompts_within(512, 512)([], []) == 0

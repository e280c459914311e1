"""The tiny models and the decode schedule the fused decode step is checked on (tests/test_cpu_fused_decode.py
against the unfused path, tests/test_cpu_int8_decode.py on integer activations)."""
import numpy as np

from engine.loader import open_model
from engine.sequence import ModelRunner, Sequence
from tests.support.tiny_gguf import write_tiny_gguf

CASES = [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0"), ("gemma3", "Q5_0"), ("gemma3", "F16")]
PROMPT_LENS = (5, 12, 21)
DECODE_STEPS = 6


def decode_logits(model, fused: bool, prompt_lens=PROMPT_LENS, together=True, shuffle_blocks=False,
                  token_by_token=False, activations="f32", kv_type="f32") -> list[np.ndarray]:
    """Logits of every decode step. Prompts are prefilled in one chunk each (the unfused path either way), or
    token_by_token through decode steps (then every K/V row comes from the path under test). activations:
    what the fused products quantise them to (int16 / int8: cpu.int8_matvec, test_cpu_int8_decode.py)."""
    model.backend.fused_decode = fused
    if model.backend.activations != activations:
        model.backend.activations = activations
        model.backend._fused.clear()  # the decoder holds the repacked weights of one choice
    runner = ModelRunner(model, num_blocks=40, block_size=4, kv_type=kv_type)
    if shuffle_blocks:  # hand out the free ids in a scrambled order: tables are not one run of blocks
        everything = runner.allocator.allocate(40)  # a freed id goes to the end of the free list
        runner.allocator.free([everything[i] for i in np.random.default_rng(0).permutation(40)])
    seqs = [Sequence([(7 * i + 3 * n) % 60 + 3 for i in range(n)]) for n in prompt_lens]
    for s in seqs:
        assert runner.ensure_blocks(s, len(s.token_ids) + DECODE_STEPS)
        while s.num_pending:
            runner.step([(s, 1 if token_by_token else s.num_pending)])
    steps = []
    for step in range(DECODE_STEPS):
        for s in seqs:
            s.token_ids.append(10 + step)
        if together:
            steps.append(runner.step([(s, 1) for s in seqs]))
        else:
            steps.append(np.concatenate([runner.step([(s, 1)]) for s in seqs]))
    model.backend.fused_decode = True
    return steps


def case_id(case) -> str:
    return f"{case[0]}-{case[1]}"


def open_case(case, tmp_path_factory):
    """The tiny model of one of CASES ((arch, weight type)), with Q8_0 embeddings."""
    arch, quant = case
    path = tmp_path_factory.mktemp(arch) / "m.gguf"
    write_tiny_gguf(path, arch, seed=3, quant=quant, embd_quant="Q8_0")
    return open_model(str(path), max_positions=256).model

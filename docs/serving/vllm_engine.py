"""vLLM's offline engine on a model folder (python docs/serving/vllm_engine.py DIR), as `trace --api vllm` runs it.

Its CPU backend wants pages of a multiple of 32 tokens and about a third of its memory setting; a budget of 64
tokens a step makes the 40-token prompt a chunked prefill, and the 70- and 44-token prompts share their first 32
tokens with it (prefix-cache hits). Run it with VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine in this process.
"""

import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=4,
          max_num_batched_tokens=64, block_size=32, dtype="float32", enable_prefix_caching=True, gpu_memory_utilization=0.3)
params = SamplingParams(max_tokens=3, detokenize=False, temperature=0)
for prompts in ((5, 20, 40, 70), (44,)):
    done = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 1 + n))) for n in prompts], params)
    print([list(o.outputs[0].token_ids) for o in done])

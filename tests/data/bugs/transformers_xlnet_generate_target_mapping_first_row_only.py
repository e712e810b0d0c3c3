# huggingface/transformers PR #7267 (XLNetLMHeadModel.prepare_inputs_for_generation).
# The query-stream target_mapping that selects the predicted (dummy, perm-masked) last slot was set only
# for batch row 0 (`target_mapping[0, 0, -1] = 1.0`), so every other row of a batched/beam decode predicts from nothing.
import sys

import torch
from transformers import XLNetConfig, XLNetLMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def prepare_inputs_for_generation(input_ids):
    # Add dummy token at the end (no attention on this one)
    effective_batch_size = input_ids.shape[0]
    dummy_token = torch.zeros((effective_batch_size, 1), dtype=torch.long, device=input_ids.device)
    input_ids = torch.cat([input_ids, dummy_token], dim=1)

    # Build permutation mask so that previous tokens don't see last token
    sequence_length = input_ids.shape[1]
    perm_mask = torch.zeros(
        (effective_batch_size, sequence_length, sequence_length), dtype=torch.float, device=input_ids.device
    )
    perm_mask[:, :, -1] = 1.0

    # We'll only predict the last token
    target_mapping = torch.zeros(
        (effective_batch_size, 1, sequence_length), dtype=torch.float, device=input_ids.device
    )
    if FIXED:
        target_mapping[:, 0, -1] = 1.0
    else:
        target_mapping[0, 0, -1] = 1.0

    return {"input_ids": input_ids, "perm_mask": perm_mask, "target_mapping": target_mapping, "use_mems": False}


config = XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.0, mem_len=None, initializer_range=0.2)
model = XLNetLMHeadModel(config).eval()


@torch.no_grad()
def greedy(input_ids, steps=4):
    all_logits = []
    for _ in range(steps):
        out = model(**prepare_inputs_for_generation(input_ids))
        next_logits = out.logits[:, -1, :]
        all_logits.append(next_logits)
        input_ids = torch.cat([input_ids, next_logits.argmax(-1, keepdim=True)], dim=1)
    return input_ids, torch.stack(all_logits, 1)


prompts = torch.randint(5, 64, (3, 6))
batched_ids, batched_logits = greedy(prompts)
diff = 0.0
for b in range(prompts.shape[0]):
    ids_b, logits_b = greedy(prompts[b : b + 1])
    diff = max(diff, (batched_logits[b] - logits_b[0]).abs().max().item())
print(f"max |batched - single-sequence| next-token logits over 4 greedy steps: {diff:.6f}")

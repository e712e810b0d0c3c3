# Correct program (quiet batch quiet-zw).
# Ported from huggingface/trl @f2cd57710ae345ea6428ae95363267fcf38a3dc8:
#   trl/trainer/dpo_trainer.py (DataCollatorForPreference.torch_call: prompt + chosen and prompt + rejected rows, the
#     attention mask built from each row's length, completion_mask 0 on the prompt and 1 on the completion, everything
#     right-padded, the batch laid [chosen..., rejected...]; DPOTrainer._compute_loss: one policy forward and one
#     reference forward with the same kwargs and use_cache=False, shift by one, selective_log_softmax, non-completion
#     tokens zeroed through the shifted completion_mask, LD-DPO length desensitisation with ld_alpha (completion
#     positions from completion_mask.cumsum, shared part up to min(chosen_len, rejected_len), tail weighted by
#     ld_alpha), "sigmoid" loss -logsigmoid(beta * delta)),
#   trl/trainer/utils.py (pad, selective_log_softmax).
# The policy and the reference are tiny LlamaForCausalLM models built from a LlamaConfig. The pad token is the eos
# token (as with many chat tokenizers) and every completion ends with eos: the collator's mask comes from lengths, so
# the closing eos stays a real, scored token while the pads after it are hidden.
# Self-check: every (prompt, completion) alone, unpadded, through both models; a loop over the completion tokens sums
# log p(token | prefix), splits the shared and tail parts by hand, and the DPO loss built from these sums must equal
# the batched loss; the policy's gradients from the two losses must agree as well.
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


# --- trl/trainer/utils.py ---
def pad(tensors, padding_value=0, padding_side="right", pad_to_multiple_of=None):
    output_shape = np.max([t.shape for t in tensors], 0).tolist()
    if pad_to_multiple_of is not None:
        remainder = output_shape[0] % pad_to_multiple_of
        if remainder != 0:
            output_shape[0] += pad_to_multiple_of - remainder
    output = torch.full((len(tensors), *output_shape), padding_value, dtype=tensors[0].dtype,
                        device=tensors[0].device)
    for i, t in enumerate(tensors):
        if padding_side == "left":
            seq_start = output_shape[0] - t.shape[0]
        elif padding_side == "right":
            seq_start = 0
        else:
            raise ValueError("padding_side must be 'left' or 'right'")
        seq_slice = slice(seq_start, seq_start + t.shape[0])
        slices = (seq_slice,) + tuple(slice(0, s) for s in t.shape[1:])
        output[i][slices] = t
    return output


def selective_log_softmax(logits, index):
    squeeze = index.ndim == logits.ndim - 1
    if squeeze:
        index = index.unsqueeze(-1)
    selected_logits = torch.gather(logits, dim=-1, index=index)
    logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
    per_token_logps = selected_logits - logsumexp_values.unsqueeze(-1)
    if squeeze:
        per_token_logps = per_token_logps.squeeze(-1)
    return per_token_logps


# --- trl/trainer/dpo_trainer.py ---
@dataclass
class DataCollatorForPreference:
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        prompt_chosen_ids = [example["prompt_ids"] + example["chosen_ids"] for example in examples]
        prompt_rejected_ids = [example["prompt_ids"] + example["rejected_ids"] for example in examples]
        chosen_mask = [[0] * len(example["prompt_ids"]) + [1] * len(example["chosen_ids"]) for example in examples]
        rejected_mask = [[0] * len(example["prompt_ids"]) + [1] * len(example["rejected_ids"])
                         for example in examples]

        chosen_attention_mask = [[1] * len(ids) for ids in prompt_chosen_ids]
        rejected_attention_mask = [[1] * len(ids) for ids in prompt_rejected_ids]
        input_ids = prompt_chosen_ids + prompt_rejected_ids
        attention_mask = chosen_attention_mask + rejected_attention_mask
        completion_mask = chosen_mask + rejected_mask

        input_ids = [torch.tensor(ids) for ids in input_ids]
        attention_mask = [torch.tensor(m, dtype=torch.long) for m in attention_mask]
        completion_mask = [torch.tensor(m, dtype=torch.long) for m in completion_mask]

        output = {}
        output["input_ids"] = pad(input_ids, padding_value=self.pad_token_id, padding_side="right",
                                  pad_to_multiple_of=self.pad_to_multiple_of)
        output["attention_mask"] = pad(attention_mask, padding_value=0, padding_side="right",
                                       pad_to_multiple_of=self.pad_to_multiple_of)
        output["completion_mask"] = pad(completion_mask, padding_value=0, padding_side="right",
                                        pad_to_multiple_of=self.pad_to_multiple_of)
        return output


class DPOStep:
    """The parts of DPOTrainer._compute_loss used for loss_type="sigmoid", f_divergence_type="reverse_kl"."""

    def __init__(self, model, ref_model, beta, ld_alpha):
        self.model = model
        self.ref_model = ref_model
        self.beta = beta
        self.ld_alpha = ld_alpha

    def _compute_loss(self, model, inputs):
        _non_model_keys = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
        model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}
        model_kwargs["use_cache"] = False
        outputs = model(**model_kwargs)

        input_ids = inputs["input_ids"]
        completion_mask = inputs["completion_mask"]
        shift_logits = outputs.logits[..., :-1, :]
        shift_labels = input_ids[..., 1:]
        shift_completion_mask = completion_mask[..., 1:]
        per_token_logps = selective_log_softmax(shift_logits, shift_labels)
        per_token_logps[shift_completion_mask == 0] = 0.0  # mask out non-completion tokens
        if self.ld_alpha is None:
            logps = per_token_logps.sum(dim=1)
        else:
            comp_pos = shift_completion_mask.cumsum(dim=1)
            comp_lens = shift_completion_mask.sum(dim=1).long()
            chosen_lens, rejected_lens = comp_lens.chunk(2, dim=0)
            shared_lens = torch.minimum(chosen_lens, rejected_lens)
            shared_lens = torch.cat([shared_lens, shared_lens], dim=0)
            shared_mask = (comp_pos > 0) & (comp_pos <= shared_lens.unsqueeze(1))
            tail_mask = comp_pos > shared_lens.unsqueeze(1)
            shared_logps = (per_token_logps * shared_mask).sum(dim=1)
            tail_logps = (per_token_logps * tail_mask).sum(dim=1)
            logps = shared_logps + self.ld_alpha * tail_logps
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)

        with torch.no_grad():
            ref_outputs = self.ref_model(**model_kwargs)
        ref_shift_logits = ref_outputs.logits[..., :-1, :]
        ref_per_token_logps = selective_log_softmax(ref_shift_logits, shift_labels)
        ref_per_token_logps[shift_completion_mask == 0] = 0.0
        if self.ld_alpha is None:
            ref_logps = ref_per_token_logps.sum(dim=1)
        else:
            ref_shared_logps = (ref_per_token_logps * shared_mask).sum(dim=1)
            ref_tail_logps = (ref_per_token_logps * tail_mask).sum(dim=1)
            ref_logps = ref_shared_logps + self.ld_alpha * ref_tail_logps
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)

        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        delta_score = chosen_logratios - rejected_logratios
        per_sequence_loss = -F.logsigmoid(self.beta * delta_score)
        loss = per_sequence_loss.mean()
        return loss, chosen_logps, rejected_logps


def reference_ld_logps(model, prompt, completion, shared_len, ld_alpha):
    # one sequence alone, no padding, no mask: loop over the completion tokens
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    total = 0.0
    for k, tok in enumerate(completion):
        t = len(prompt) + k
        lp = torch.log_softmax(logits[t - 1], dim=-1)[tok]
        total = total + (lp if k < shared_len else ld_alpha * lp)
    return total


def main():
    eos = 2
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg).double()
    torch.manual_seed(1)
    ref_model = LlamaForCausalLM(cfg).double().eval()
    policy.eval()  # no dropout, so both paths are deterministic

    g = torch.Generator().manual_seed(2)

    def toks(n):
        return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()

    examples = [
        {"prompt_ids": [1] + toks(4), "chosen_ids": toks(3) + [eos], "rejected_ids": toks(6) + [eos]},
        {"prompt_ids": [1] + toks(1), "chosen_ids": toks(7) + [eos], "rejected_ids": toks(2) + [eos]},
        {"prompt_ids": [1] + toks(6), "chosen_ids": toks(1) + [eos], "rejected_ids": toks(1) + [eos]},
    ]
    beta, ld_alpha = 0.1, 0.5
    inputs = DataCollatorForPreference(pad_token_id=cfg.pad_token_id, pad_to_multiple_of=4)(examples)
    assert (inputs["attention_mask"] == 0).any()

    step = DPOStep(policy, ref_model, beta=beta, ld_alpha=ld_alpha)
    loss, chosen_logps, rejected_logps = step._compute_loss(policy, inputs)
    policy.zero_grad()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}

    # reference: every sequence alone
    ref_c, ref_r, pol_c, pol_r = [], [], [], []
    for ex in examples:
        shared = min(len(ex["chosen_ids"]), len(ex["rejected_ids"]))
        pol_c.append(reference_ld_logps(policy, ex["prompt_ids"], ex["chosen_ids"], shared, ld_alpha))
        pol_r.append(reference_ld_logps(policy, ex["prompt_ids"], ex["rejected_ids"], shared, ld_alpha))
        with torch.no_grad():
            ref_c.append(reference_ld_logps(ref_model, ex["prompt_ids"], ex["chosen_ids"], shared, ld_alpha))
            ref_r.append(reference_ld_logps(ref_model, ex["prompt_ids"], ex["rejected_ids"], shared, ld_alpha))
    pol_c, pol_r = torch.stack(pol_c), torch.stack(pol_r)
    ref_c, ref_r = torch.stack(ref_c), torch.stack(ref_r)
    ref_loss = -F.logsigmoid(beta * ((pol_c - ref_c) - (pol_r - ref_r))).mean()
    policy.zero_grad()
    ref_loss.backward()

    assert torch.allclose(chosen_logps, pol_c, atol=1e-9), (chosen_logps, pol_c)
    assert torch.allclose(rejected_logps, pol_r, atol=1e-9), (rejected_logps, pol_r)
    assert torch.allclose(loss, ref_loss, atol=1e-10), (loss.item(), ref_loss.item())
    for n, p in policy.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-9), n
    print(f"DPO (LD alpha={ld_alpha}) loss {loss.item():.10f} == per-sequence reference {ref_loss.item():.10f}; "
          f"gradients agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Time-Search/TimeSearch-R#7: in the multi-turn GRPO trainer the tool-response mask (meant for the loss only)
# is multiplied into completion_mask, which is then concatenated into the attention_mask used to recompute
# per-token log-probs, so the policy/reference forwards cannot attend to the tool outputs they were conditioned on.
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, EOS, TOOL_START, TOOL_END = 0, 1, 2, 3


def compute_tool_response_mask(completion_ids):
    """1 for tokens the policy generated, 0 for tokens inside <tool_response> ... </tool_response>."""
    mask = torch.ones_like(completion_ids)
    for b in range(completion_ids.size(0)):
        inside = False
        for t in range(completion_ids.size(1)):
            tok = completion_ids[b, t].item()
            if tok == TOOL_START:
                inside = True
            elif tok == TOOL_END:
                inside = False
                continue
            if inside:
                mask[b, t] = 0
    return mask


class GRPOTrainerEnv:
    def __init__(self, model, ref_model, beta=0.04):
        self.model = model
        self.ref_model = ref_model
        self.beta = beta

    def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1, :]
        input_ids = input_ids[:, -logits_to_keep:]
        logits = logits[:, -logits_to_keep:]
        return torch.gather(logits.log_softmax(-1), 2, input_ids.unsqueeze(-1)).squeeze(-1)

    def _prepare_inputs(self, prompt_ids, prompt_mask, completion_ids):
        # Mask everything after the first EOS token
        is_eos = completion_ids == EOS
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()

        tool_mask = compute_tool_response_mask(completion_ids)
        if FIXED:
            # tool outputs stay visible as context; they are only excluded from the loss
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            completion_mask = tool_mask * completion_mask
        else:
            completion_mask = tool_mask * completion_mask
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)

        prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        logits_to_keep = completion_ids.size(1)
        with torch.no_grad():
            old_per_token_logps = self._get_per_token_logps(self.model, prompt_completion_ids, attention_mask, logits_to_keep)
            ref_per_token_logps = self._get_per_token_logps(self.ref_model, prompt_completion_ids, attention_mask, logits_to_keep)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "attention_mask": attention_mask,
            "old_per_token_logps": old_per_token_logps,
            "ref_per_token_logps": ref_per_token_logps,
        }

    def compute_loss(self, inputs, advantages):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)
        per_token_logps = self._get_per_token_logps(self.model, input_ids, inputs["attention_mask"], logits_to_keep)
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        coef = torch.exp(per_token_logps - inputs["old_per_token_logps"])
        per_token_loss = -(coef * advantages.unsqueeze(1) - self.beta * per_token_kl)
        mask = inputs["completion_mask"]
        loss = ((per_token_loss * mask).sum(dim=1) / mask.sum(dim=1)).mean()
        return loss, per_token_logps


def main():
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, eos_token_id=EOS, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).eval()
    ref_model = Qwen2ForCausalLM(config).eval()
    trainer = GRPOTrainerEnv(model, ref_model)

    # left-padded prompts
    prompt_ids = torch.tensor([[PAD, PAD, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25]])
    prompt_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    # completion: model call, <tool_response> obs </tool_response>, model answer, EOS, right padding
    completion_ids = torch.tensor([
        [30, 31, TOOL_START, 40, 41, 42, TOOL_END, 32, 33, EOS, PAD, PAD],
        [34, 35, 36, TOOL_START, 43, 44, TOOL_END, 37, 38, 39, EOS, PAD],
    ])
    inputs = trainer._prepare_inputs(prompt_ids, prompt_mask, completion_ids)
    loss, logps = trainer.compute_loss(inputs, advantages=torch.tensor([1.0, -1.0]))

    # reference: the tokens after the tool response, scored with every real token visible
    full_mask = torch.cat([prompt_mask, (completion_ids != PAD).long()], dim=1)
    full_mask[:, -2:] = torch.tensor([[0, 0], [0, 0]])
    full_mask[1, -2] = 1
    with torch.no_grad():
        ref_logps = trainer._get_per_token_logps(model, torch.cat([prompt_ids, completion_ids], 1), full_mask, completion_ids.size(1))
    answer = inputs["completion_mask"].bool() & (torch.arange(12) > 6)
    diff = (logps.detach() - ref_logps)[answer].abs().max().item()
    print(f"fixed={FIXED} loss={loss.item():.4f} max |logp - logp(with tool context)| on answer tokens = {diff:.3e}")


if __name__ == "__main__":
    main()

# PrimeIntellect-ai/prime-rl#3466 ("fix(trainer): zero-index position_ids fallback in LM-head wrapper").
# The trainer patches the model's forward so the LM head runs inside its own wrapper (per-token
# log-probs for the RL loss). When the batch comes without position_ids, the patched forward made
# its own fallback as arange(1, seq_len + 1): one-indexed. For RoPE only the differences matter, but
# a model keyed on absolute positions (here a GPT-2 style learned position table) sees every token
# one slot late. Fix: the fallback is arange(0, seq_len), the usual zero-indexed positions.
import sys

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def _patch_model_forward(model):
    """Run the backbone, then the LM head and the per-token log-probs in the wrapper."""
    backbone = model.transformer
    lm_head = model.lm_head

    def patched_forward(input_ids, position_ids=None, temperature=1.0, **kwargs):
        if position_ids is None:
            seq_len = input_ids.shape[1]
            if FIXED:
                position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
            else:
                position_ids = torch.arange(1, seq_len + 1, device=input_ids.device).unsqueeze(0)
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        hidden = backbone(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        logits = lm_head(hidden[:, :-1]).float() / temperature
        return selective_log_softmax(logits, input_ids[:, 1:])

    model.forward = patched_forward
    return model


def main():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0.0, 0.5)
    model = _patch_model_forward(model)

    # one micro batch of prompt + completion rows, all the same length (no padding)
    input_ids = torch.randint(3, 97, (2, 12))
    loss_mask = torch.zeros_like(input_ids[:, 1:], dtype=torch.bool)
    loss_mask[:, 5:] = True  # completion tokens

    with torch.no_grad():
        logprobs = model(input_ids)
        old_logprobs = logprobs.detach()
        advantages = torch.tensor([[1.0], [-1.0]])
        ratio = torch.exp(logprobs - old_logprobs)
        loss = -(ratio * advantages * loss_mask).sum() / loss_mask.sum()

    print("completion logprob sums:", [round(v, 4) for v in (logprobs * loss_mask).sum(-1).tolist()])
    print("loss:", round(loss.item(), 4))


if __name__ == "__main__":
    main()

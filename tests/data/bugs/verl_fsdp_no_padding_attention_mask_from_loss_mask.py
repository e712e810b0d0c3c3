"""verl FSDP LM engine: attention_mask for the dense forward built from the response-only loss_mask.

Citation: verl-project/verl#6278 (issue, "attention_mask seems wrong in fdsp when use_remove_padding is
False"), fixed by verl-project/verl#6345 ("[fsdp] fix: build no-padding attention mask from input ids").
I read the issue and the PR description, not the full diff; the helper name below is the PR's.

Bug: with pad_mode=NO_PADDING and use_remove_padding=False the engine pads the jagged (nested) input_ids
(prompt + response) back to a dense [batch, max_seq_len] tensor, but builds the attention_mask from
loss_mask, which covers only the response. For full lengths [5, 3] and response lengths [2, 1] the mask
came out [[1,1,0,0,0],[1,0,0,0,0]] instead of [[1,1,1,1,1],[1,1,1,0,0]]: the training-policy forward
attends a different sequence than the rollout (PPO KL / clipfrac high before any update).

Fix: build_attention_mask_from_nested() derives the mask from the jagged input_ids' own lengths.

This program: two jagged rows (prompt + response) as torch nested tensors (strided layout here: the
jagged layout verl uses imports torch._dynamo and doubles the run time; the padding is the same), the engine's
prepare_model_inputs padding them back to dense, and a small causal LM whose attention layer combines
the 2-D attention_mask with the causal triangle and calls F.scaled_dot_product_attention.
"""
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class EngineConfig:
    pad_mode: str = "no_padding"
    use_remove_padding: bool = False
    pad_token_id: int = 0


class Attention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, attention_mask):
        bsz, seq_len, _ = x.shape
        q, k, v = self.qkv(x).view(bsz, seq_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(Attention(hidden_size, num_heads) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids, attention_mask):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask)
        return self.lm_head(h)


def build_attention_mask_from_nested(input_ids, max_seq_len):
    seq_len_effective = torch.tensor([t.numel() for t in input_ids.unbind()])
    positions = torch.arange(int(max_seq_len)).unsqueeze(0)
    return (positions < seq_len_effective.unsqueeze(1)).to(torch.int32)


def prepare_model_inputs(config, micro_batch):
    input_ids = micro_batch["input_ids"]  # jagged: prompt + response
    loss_mask = micro_batch["loss_mask"]  # jagged: response tokens only
    batch_size = input_ids.size(0)
    max_seq_len = max(t.numel() for t in input_ids.unbind())
    if config.pad_mode == "no_padding" and not config.use_remove_padding:
        dense_ids = input_ids.to_padded_tensor(config.pad_token_id, output_size=(batch_size, max_seq_len))
        if FIXED:
            attention_mask = build_attention_mask_from_nested(input_ids, max_seq_len)
        else:
            attention_mask = loss_mask.to_padded_tensor(0, output_size=(batch_size, max_seq_len)).to(torch.int32)
        return {"input_ids": dense_ids, "attention_mask": attention_mask}
    raise NotImplementedError(config.pad_mode)


def main():
    torch.manual_seed(0)
    config = EngineConfig()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses = [torch.tensor([11, 12]), torch.tensor([13])]
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
    input_ids = torch.nested.nested_tensor([torch.cat([p, r]) for p, r in zip(prompts, responses)])
    loss_mask = torch.nested.nested_tensor([torch.ones_like(r) for r in responses])
    model = TinyCausalLM().eval()
    inputs = prepare_model_inputs(config, {"input_ids": input_ids, "loss_mask": loss_mask})
    with torch.no_grad():
        logits = model(**inputs)
    log_probs = logits.log_softmax(-1)
    print("attention_mask", inputs["attention_mask"].tolist())
    print("old_log_prob[0, -1] %.4f" % log_probs[0, -1].max().item())


if __name__ == "__main__":
    main()

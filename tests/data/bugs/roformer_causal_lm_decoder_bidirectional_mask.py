"""transformers RoFormerForCausalLM (is_decoder=True): the model builds a bidirectional mask, so CLM training sees the future.

Citation: huggingface/transformers#48745 ("RoFormerForCausalLM, BigBirdForCausalLM, RemBertForCausalLM,
MegatronBertForCausalLM attend to future tokens since v5.9.0"), fixed by huggingface/transformers#48760.

Bug: after the attention-mask refactor, ``RoFormerModel.forward`` (and BigBird, RemBert, MegatronBert)
called ``create_bidirectional_mask(config, input_embeds, attention_mask)`` unconditionally. With
``config.is_decoder = True`` (``RoFormerForCausalLM``, trained with shifted labels) every position attends
the tokens after it, its own label included; the loss collapses on random tokens.
Fix (as the PR describes it; I did not read its diff): ``if self.config.is_decoder: create_causal_mask(...)``
else ``create_bidirectional_mask(...)``, as ``BertModel`` does.

This program: a one-layer RoFormer-style encoder written in plain torch (the two mask builders reduced to
what they return for this input: a boolean ``[B, 1, q, kv]`` mask, key padding and, for the causal one,
``kv <= q``; rotary embeddings left out) driven by a ``RoFormerConfig`` with ``is_decoder=True``, SDPA
attention, a right-padded batch of lengths [6, 4] and the causal-LM loss with shifted labels.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class RoFormerConfig:
    vocab_size: int = 50
    hidden_size: int = 32
    num_attention_heads: int = 4
    is_decoder: bool = False
    pad_token_id: int = 0


def create_bidirectional_mask(config, input_embeds, attention_mask):
    batch_size, kv_length = attention_mask.shape
    q_length = input_embeds.shape[1]
    return attention_mask.bool()[:, None, None, :].expand(batch_size, 1, q_length, kv_length)


def create_causal_mask(config, input_embeds, attention_mask, cache_position, past_key_values=None):
    padding = create_bidirectional_mask(config, input_embeds, attention_mask)
    kv_idx = torch.arange(attention_mask.shape[1])
    causal = kv_idx[None, :] <= cache_position[:, None]
    return padding & causal[None, None]


class RoFormerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, s, d = hidden_states.shape
        shape = (b, s, self.num_attention_heads, -1)
        q = self.query(hidden_states).view(shape).transpose(1, 2)
        k = self.key(hidden_states).view(shape).transpose(1, 2)
        v = self.value(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return hidden_states + self.output(out.transpose(1, 2).reshape(b, s, d))


class RoFormerModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layer = RoFormerSelfAttention(config)

    def forward(self, input_ids, attention_mask=None):
        embedding_output = self.embeddings(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if FIXED and self.config.is_decoder:
            cache_position = torch.arange(input_ids.shape[1])
            attention_mask = create_causal_mask(
                config=self.config,
                input_embeds=embedding_output,
                attention_mask=attention_mask,
                cache_position=cache_position,
            )
        else:
            attention_mask = create_bidirectional_mask(
                config=self.config, input_embeds=embedding_output, attention_mask=attention_mask
            )
        return self.layer(embedding_output, attention_mask=attention_mask)


class RoFormerForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.roformer = RoFormerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.lm_head(self.roformer(input_ids, attention_mask=attention_mask))
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        return loss, logits


def main():
    torch.manual_seed(0)
    config = RoFormerConfig(is_decoder=True)
    model = RoFormerForCausalLM(config).eval()
    input_ids = torch.tensor([[5, 17, 9, 33, 12, 40], [7, 21, 8, 30, 0, 0]])
    attention_mask = (input_ids != config.pad_token_id).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with torch.no_grad():
        loss, _ = model(input_ids, attention_mask=attention_mask, labels=labels)
    print("clm loss %.4f" % loss)


if __name__ == "__main__":
    main()

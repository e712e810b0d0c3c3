"""ChatGLM-6B LoRA fine-tuning step that passes an all-True (= all masked) attention mask.

Citation: mymusise/ChatGLM-Tuning PR #30 ("update mask_position & position_ids", merged as
fc1585b; commits b89ee70 "update mask" and 1f2e9d1 "fix mask_position"). Upstream files:
finetune.py (ModifiedTrainer.compute_loss, data_collator) and modeling_chatglm.py.

Bug: `ModifiedTrainer.compute_loss` called the model with
`attention_mask=torch.ones(1, 1, L, L).bool()`. ChatGLM's mask convention is True = masked
(`get_masks` builds `(attention_mask < 0.5).bool()`), and the attention does
`if not (attention_mask == 0).all(): attention_scores.masked_fill_(attention_mask, -10000.0)`,
so *every* score became -10000 and each token attended uniformly to all positions, future
target tokens included (and the loss was taken on the prompt too: labels=input_ids).

Fix: the collator builds the GLM prefix-LM mask per example with
`get_masks_and_position_ids(ids, seq_len, longest, ...)` (lower triangle, plus full attention
on the context columns `[:seq_len - 1]`, then `< 0.5` so True = masked), with 2D position ids,
and compute_loss passes `attention_mask`, `position_ids` and prompt-masked `labels`.

Reproduction: finetune.py's collator and compute_loss as in the two versions; a two-layer
stand-in for ChatGLM with random weights keeps its [seq, batch, hidden] layout and its
masked_fill / softmax attention (rotary 2D positions replaced by two learned position tables).
Token ids use ChatGLM-6B's specials (gMASK 150001, bos/<sop> 150004, eos 150005), remapped into
a small vocabulary. Run with --fixed for the code after the fix.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

VOCAB = 64
GMASK, BOS, EOS, PAD = 61, 62, 63, 60  # stand-ins for 150001, 150004 (<sop>), 150005, pad


class Tokenizer:
    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD


tokenizer = Tokenizer()


def get_masks_and_position_ids(seq, seq_len, context_length, device, gmask=False, position_encoding_2d=True):
    mask_position = seq_len - 1
    attention_mask = torch.ones((1, context_length, context_length), device=device)
    attention_mask.tril_()
    attention_mask[..., :mask_position] = 1
    attention_mask = (attention_mask < 0.5).bool()

    if position_encoding_2d:
        seq_length = seq.index(tokenizer.bos_token_id)
        position_ids = torch.arange(context_length, dtype=torch.long, device=device)
        if not gmask:
            position_ids[seq_length:] = mask_position
        block_position_ids = torch.cat(
            (
                torch.zeros(seq_length, dtype=torch.long, device=device),
                torch.arange(context_length - seq_length, dtype=torch.long, device=device) + 1,
            )
        )
        position_ids = torch.stack((position_ids, block_position_ids), dim=0)
    else:
        position_ids = torch.arange(context_length, dtype=torch.long, device=device)
        if not gmask:
            position_ids[context_length - 1:] = mask_position
    return attention_mask, position_ids


def data_collator(features: list) -> dict:
    len_ids = [len(feature["input_ids"]) for feature in features]
    longest = max(len_ids)
    if not FIXED:
        input_ids = []
        for ids_l, feature in sorted(zip(len_ids, features), key=lambda x: -x[0]):
            ids = feature['input_ids']
            _ids = torch.LongTensor(ids + [BOS] * (longest - ids_l))  # upstream padded with 150004
            input_ids.append(_ids)
        return {"input_ids": torch.stack(input_ids)}
    input_ids = []
    attention_mask_list = []
    position_ids_list = []
    labels_list = []
    for ids_l, feature in sorted(zip(len_ids, features), key=lambda x: -x[0]):
        ids = feature["input_ids"]
        seq_len = feature["seq_len"]
        ids = ids + [tokenizer.pad_token_id] * (longest - ids_l)
        labels = [-100] * (seq_len - 1) + ids[(seq_len - 1):]
        _ids = torch.LongTensor(ids)
        attention_mask, position_ids = get_masks_and_position_ids(ids, seq_len, longest, _ids.device, gmask=False)
        labels_list.append(torch.LongTensor(labels))
        input_ids.append(_ids)
        attention_mask_list.append(attention_mask)
        position_ids_list.append(position_ids)
    return {
        "input_ids": torch.stack(input_ids),
        "labels": torch.stack(labels_list),
        "attention_mask": torch.stack(attention_mask_list),
        "position_ids": torch.stack(position_ids_list),
    }


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [seq_len, batch, hidden_size]
        sq, b, h = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, self.num_attention_heads, 3 * self.hidden_size_per_attention_head)
        query_layer, key_layer, value_layer = mixed.chunk(3, dim=-1)
        # [b, np, sq, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        attention_scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.hidden_size_per_attention_head)
        if not (attention_mask == 0).all():
            # if auto-regressive, skip
            attention_scores.masked_fill_(attention_mask, -10000.0)
        attention_probs = F.softmax(attention_scores.float(), dim=-1)
        context_layer = torch.matmul(attention_probs, v).permute(2, 0, 1, 3).reshape(sq, b, h)
        return self.dense(context_layer)


class GLMBlock(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.attention = SelfAttention(hidden_size, num_attention_heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ChatGLMForConditionalGeneration(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, num_layers=2, max_position=64):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, hidden_size)
        self.position_embeddings = nn.Embedding(max_position, hidden_size)
        self.block_position_embeddings = nn.Embedding(max_position, hidden_size)
        self.layers = nn.ModuleList([GLMBlock(hidden_size, num_attention_heads) for _ in range(num_layers)])
        self.final_layernorm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        b, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.stack((torch.arange(L), torch.zeros(L, dtype=torch.long)))[None].expand(b, 2, L)
        if attention_mask is None:
            attention_mask = torch.zeros(1, 1).bool()
        hidden_states = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids[:, 0])
                         + self.block_position_embeddings(position_ids[:, 1])).transpose(0, 1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        lm_logits = self.lm_head(self.final_layernorm(hidden_states)).permute(1, 0, 2)
        shift_logits = lm_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, VOCAB), shift_labels.view(-1), ignore_index=-100)


class ModifiedTrainer:
    def compute_loss(self, model, inputs, return_outputs=False):
        if FIXED:
            return model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                position_ids=inputs["position_ids"],
                labels=inputs["labels"],
            )
        input_shape = inputs["input_ids"].shape
        return model(
            input_ids=inputs["input_ids"],
            attention_mask=torch.ones(1, 1, input_shape[-1], input_shape[-1]).bool(),
            labels=inputs["input_ids"],
        )


def preprocess(prompt_ids, target_ids):
    """tokenize_dataset_rows.preprocess: the ChatGLM tokenizer ends the prompt with [gMASK] <sop>."""
    prompt_ids = prompt_ids + [GMASK, BOS]
    input_ids = prompt_ids + target_ids + [tokenizer.eos_token_id]
    return {"input_ids": input_ids, "seq_len": len(prompt_ids)}


def main():
    torch.manual_seed(0)
    features = [preprocess([5, 9, 14, 22, 7], [31, 17, 40, 12]),
                preprocess([8, 3, 11], [25, 26, 27])]
    model = ChatGLMForConditionalGeneration().eval()
    batch = data_collator(features)
    with torch.no_grad():
        loss = ModifiedTrainer().compute_loss(model, batch)
    print("loss %.5f" % loss.item())


if __name__ == "__main__":
    main()

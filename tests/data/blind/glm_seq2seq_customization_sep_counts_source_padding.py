"""GLM seq2seq fine-tuning: the bidirectional span `sep` includes the source padding (GLM#70).

Citation: THUDM/GLM#70 ("Bug of finetuning code? the attention mask of padding is not 0.",
closed). Fixed by commit 2ab0add9cdce5a47a2054088dad7f157dfdd7623 ("Add mask-pad-token for
seq2seq tasks", 2023-01-24), which adds ``--mask-pad-token`` and an explicit (L, L) mask in
``CustomizationDataset.__getitem__``, completed by 9115330ebb5079fff1b9007c607cae86cc2134a5
("Fix attention_mask for seq2seq tasks when mask_pad_token": the missing leading axis, GLM#105).
Both diffs and mpu/transformer.py's build_mask_matrix were read from the GLM git history.

Bug: ``CustomizationDataset`` pads ``source_tokens`` to ``max_src_length`` and then sets
``sep = len(source_tokens)``; the sample's ``attention_mask`` is that scalar, and the
transformer's ``build_mask_matrix`` makes every key before ``sep`` visible to every query. So
all source tokens and all target tokens attend to the source's padding.

Fix: with ``mask_pad_token`` the dataset builds the mask itself: keys ``[:context_length]``
(the real source) visible to all queries, the target block lower-triangular, padding hidden.

Reproduction: the train-split ``__getitem__`` with args in an argparse Namespace, a toy
tokenizer exposing GLM's command tokens, the default collate (stack), and a two-layer GLM
transformer with block position ids whose attention does ``scores * ltor_mask - 65504 * (1 -
ltor_mask)`` before softmax. Source lengths 3 and 5 words with max_src_length 8.
"""
import argparse
import math
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class ToyGLMTokenizer:
    commands = {"pad": 0, "ENC": 1, "MASK": 2, "sMASK": 3, "eos": 4, "sop": 5}

    def __init__(self):
        self.vocab = {}

    def get_command(self, name):
        return SimpleNamespace(Id=self.commands[name])

    def EncodeAsIds(self, text):
        ids = [self.vocab.setdefault(w, 6 + len(self.vocab)) for w in text.split()]
        return SimpleNamespace(tokenization=ids)


class CustomizationDataset(torch.utils.data.Dataset):
    def __init__(self, args, split, tokenizer, example_list):
        self.max_src_length, self.max_tgt_length = args.src_seq_length, args.tgt_seq_length
        self.split = split
        self.tokenizer = tokenizer
        self.mask_pad_token = getattr(args, "mask_pad_token", False)
        self.no_block_position = args.no_block_position
        self.task_mask = args.task_mask
        self.example_list = example_list

    def __len__(self):
        return len(self.example_list)

    def __getitem__(self, idx):
        example = self.example_list[idx]
        cls_id = self.tokenizer.get_command('ENC').Id
        mask_token = 'sMASK' if self.task_mask else 'MASK'
        mask_id = self.tokenizer.get_command(mask_token).Id
        eos_id = self.tokenizer.get_command('eos').Id
        pad_id = self.tokenizer.get_command('pad').Id
        sop_id = self.tokenizer.get_command('sop').Id
        source_text, target_text = example.text_a, example.meta["ref"]
        source_tokens = self.tokenizer.EncodeAsIds(" " + source_text).tokenization
        if len(source_tokens) + 3 > self.max_src_length:
            source_tokens = source_tokens[-(self.max_src_length - 3):]
        source_tokens = [cls_id] + source_tokens + [mask_id, eos_id]
        context_length = len(source_tokens)
        if len(source_tokens) < self.max_src_length:
            source_tokens = source_tokens + [pad_id] * (self.max_src_length - len(source_tokens))
        sep = len(source_tokens)
        position_ids = list(range(len(source_tokens)))
        block_position_ids = [0] * len(source_tokens)
        mask_pos = source_tokens.index(mask_id)
        target_tokens = self.tokenizer.EncodeAsIds(" " + target_text).tokenization
        target_tokens = target_tokens + [eos_id]
        if len(target_tokens) > self.max_tgt_length:
            target_tokens = target_tokens[:self.max_tgt_length]
        loss_mask = [1] * len(target_tokens)
        if len(target_tokens) < self.max_tgt_length:
            loss_mask += [0] * (self.max_tgt_length - len(target_tokens))
            target_tokens += [pad_id] * (self.max_tgt_length - len(target_tokens))
        if self.mask_pad_token:
            attention_mask = np.zeros((self.max_src_length + self.max_tgt_length,
                                       self.max_src_length + self.max_tgt_length), dtype=np.int64)
            attention_mask[:, :context_length] = 1
            attention_mask[self.max_src_length:, self.max_src_length:] = np.tril(
                np.ones((self.max_tgt_length, self.max_tgt_length), dtype=np.int64))
            attention_mask = attention_mask[None, :, :]
        else:
            attention_mask = np.array(sep, dtype=np.int64)
        tokens = source_tokens + [sop_id] + target_tokens[:-1]
        loss_mask = [0] * len(source_tokens) + loss_mask
        target_ids = [0] * len(source_tokens) + target_tokens
        position_ids += [mask_pos] * len(target_tokens)
        if self.no_block_position:
            block_position_ids += [1] * len(target_tokens)
        else:
            block_position_ids += list(range(1, len(target_tokens) + 1))
        position_ids = [position_ids, block_position_ids]
        return {'text': np.array(tokens, dtype=np.int64), 'target': np.array(target_ids, dtype=np.int64),
                'attention_mask': attention_mask, 'loss_mask': np.array(loss_mask, dtype=np.int64),
                "position_id": np.array(position_ids, dtype=np.int64), "uid": idx}


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def _transpose_for_scores(self, tensor):
        new_tensor_shape = tensor.size()[:-1] + (self.num_attention_heads, self.hidden_size_per_attention_head)
        return tensor.view(*new_tensor_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, ltor_mask):
        # ltor_mask: [b, 1, s, s] (or [1, 1, s, s])
        q, k, v = self.query_key_value(hidden_states).chunk(3, dim=-1)
        query_layer, key_layer, value_layer = map(self._transpose_for_scores, (q, k, v))
        attention_scores = torch.matmul(query_layer / math.sqrt(self.hidden_size_per_attention_head),
                                        key_layer.transpose(-1, -2))
        attention_scores = torch.mul(attention_scores, ltor_mask)
        attention_scores = attention_scores + (-65504.0) * (1.0 - ltor_mask)
        attention_probs = torch.nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return self.dense(context_layer.view(*context_layer.size()[:-2], -1))


class GLMLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.attention = SelfAttention(hidden_size, num_attention_heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, hidden_states, ltor_mask):
        hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states), ltor_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class GLMModel(nn.Module):
    def __init__(self, vocab_size, hidden_size, num_layers, num_attention_heads, max_sequence_length):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_sequence_length, hidden_size)
        self.block_position_embeddings = nn.Embedding(max_sequence_length, hidden_size)
        self.layers = nn.ModuleList(GLMLayer(hidden_size, num_attention_heads) for _ in range(num_layers))
        self.final_layernorm = nn.LayerNorm(hidden_size)

    def forward(self, input_ids, position_ids, attention_mask):
        hidden_states = self.word_embeddings(input_ids)
        batch_size, query_length = input_ids.shape
        is_scalar = torch.numel(attention_mask) == 1
        is_sep = is_scalar or torch.numel(attention_mask) == batch_size
        if is_sep:
            sep = attention_mask.item() if is_scalar else attention_mask

            # conventional transformer
            def build_mask_matrix(seq_length, sep, memory_length=0):
                m = hidden_states.new_ones((1, seq_length, seq_length))
                m = torch.tril(m)
                if is_scalar:
                    m[0, :, :sep] = 1
                else:
                    m = m.expand(batch_size, -1, -1)
                    ids = torch.arange(seq_length, device=sep.device, dtype=sep.dtype).view(1, -1)
                    mask = ids < sep.view(-1, 1)
                    m = m.masked_fill(mask.unsqueeze(1).expand_as(m), 1)
                m = m.unsqueeze(1)
                return m

            attention_mask = build_mask_matrix(query_length, sep)
        else:
            attention_mask = attention_mask.type_as(hidden_states)
            attention_mask = attention_mask[:, :, :, -query_length:]
        position_ids, block_position_ids = position_ids[:, 0], position_ids[:, 1]
        hidden_states = hidden_states + self.position_embeddings(position_ids) \
            + self.block_position_embeddings(block_position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.final_layernorm(hidden_states)


def main():
    torch.manual_seed(0)
    args = argparse.Namespace(src_seq_length=8, tgt_seq_length=4, no_block_position=False, task_mask=False)
    if FIXED:
        args.mask_pad_token = True
    examples = [SimpleNamespace(text_a="the cat sat", meta={"ref": "cat sat"}),
                SimpleNamespace(text_a="a dog ran very fast", meta={"ref": "dog ran fast"})]
    dataset = CustomizationDataset(args, "train", ToyGLMTokenizer(), examples)
    batch = torch.utils.data.default_collate([dataset[i] for i in range(len(dataset))])
    model = GLMModel(vocab_size=32, hidden_size=32, num_layers=2, num_attention_heads=4, max_sequence_length=16).eval()
    with torch.no_grad():
        out = model(batch["text"], batch["position_id"], batch["attention_mask"])
    print("out", tuple(out.shape), "attention_mask", tuple(batch["attention_mask"].shape),
          "row0 sop sum", round(float(out[0, 8, :8].sum()), 4))


if __name__ == "__main__":
    main()

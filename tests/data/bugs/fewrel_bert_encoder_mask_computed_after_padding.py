"""FewRel BERTSentenceEncoder: the attention mask is computed after padding, so it is all ones.

Citation: thunlp/FewRel issue #17 "mask didn't work" (closed): "I found that the mask
operator in sentence_encoder.py didn't work ... Maybe we should reverse their positions
(mask first and then padding). Right?"; maintainer gaotianyu1350: "Thanks for the
reminder. I have fixed the bug now." The issue's screenshot was not readable here; the
buggy `tokenize` (pad, truncate, then `mask[:len(indexed_tokens)] = 1`) was read in
stored copies of fewshot_re_kit/sentence_encoder.py that predate the fix, and the fixed
order (mask from the unpadded tokens, then padding) in a stored fixed copy.

Bug: `tokenize` appends pad ids until `len(indexed_tokens) == max_length` and only then
writes `mask[:len(indexed_tokens)] = 1`, so every position is marked real;
`BERTSentenceEncoder.forward` hands that mask to `self.bert(inputs['word'],
attention_mask=inputs['mask'])` and the [CLS] representation attends to the padding.
Fix: build the mask from the length before padding.

Reproduction: FewRel's `tokenize` / batch collation / `BERTSentenceEncoder.forward` over a
small plain-torch stand-in for pytorch_pretrained_bert's `BertModel` (embeddings,
`extended_attention_mask = (1.0 - attention_mask[:, None, None, :]) * -10000.0` added
to the scores, softmax, pooler on [CLS]; random weights, no downloads); a word-level
stand-in tokenizer replaces `BertTokenizer`. Two sentences of 5 and 9 tokens padded to
max_length 12.
"""
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class WordTokenizer:
    """Stand-in for BertTokenizer.convert_tokens_to_ids over a fixed vocabulary."""

    def __init__(self, words):
        self.vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))

    def convert_tokens_to_ids(self, tokens):
        return [self.vocab.get(t, 1) for t in tokens]


class BertLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, intermediate_size):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.attn_out = nn.Linear(hidden_size, hidden_size)
        self.attn_norm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.intermediate = nn.Linear(hidden_size, intermediate_size)
        self.output = nn.Linear(intermediate_size, hidden_size)
        self.out_norm = nn.LayerNorm(hidden_size, eps=1e-12)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / self.attention_head_size ** 0.5
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (-1,))
        h = self.attn_norm(hidden_states + self.attn_out(context_layer))
        return self.out_norm(h + self.output(torch.nn.functional.gelu(self.intermediate(h))))


class BertModel(nn.Module):
    """Small stand-in for pytorch_pretrained_bert.BertModel (random weights)."""

    def __init__(self, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=32):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size)
        self.emb_norm = nn.LayerNorm(hidden_size, eps=1e-12)
        self.layer = nn.ModuleList([BertLayer(hidden_size, num_attention_heads, intermediate_size)
                                    for _ in range(num_hidden_layers)])
        self.pooler = nn.Linear(hidden_size, hidden_size)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2).float()
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        positions = torch.arange(input_ids.size(1))
        hidden = self.emb_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        for layer_module in self.layer:
            hidden = layer_module(hidden, extended_attention_mask)
        pooled_output = torch.tanh(self.pooler(hidden[:, 0]))
        return hidden, pooled_output


class BERTSentenceEncoder(nn.Module):
    def __init__(self, bert, tokenizer, max_length):
        nn.Module.__init__(self)
        self.bert = bert
        self.max_length = max_length
        self.tokenizer = tokenizer

    def forward(self, inputs):
        _, x = self.bert(inputs['word'], attention_mask=inputs['mask'])
        return x

    def tokenize(self, raw_tokens):
        # token -> index
        tokens = ['[CLS]'] + [token.lower() for token in raw_tokens]
        indexed_tokens = self.tokenizer.convert_tokens_to_ids(tokens)

        if FIXED:
            # mask
            mask = np.zeros((self.max_length), dtype=np.int32)
            mask[:len(indexed_tokens)] = 1

        # padding
        while len(indexed_tokens) < self.max_length:
            indexed_tokens.append(0)
        indexed_tokens = indexed_tokens[:self.max_length]

        if not FIXED:
            # mask
            mask = np.zeros((self.max_length), dtype=np.int32)
            mask[:len(indexed_tokens)] = 1

        return indexed_tokens, mask


def collate_fn(encoder, sentences):
    batch = {'word': [], 'mask': []}
    for raw_tokens in sentences:
        word, mask = encoder.tokenize(raw_tokens)
        batch['word'].append(word)
        batch['mask'].append(mask)
    return {k: torch.tensor(np.array(v)).long() for k, v in batch.items()}


def main():
    torch.manual_seed(0)
    sentences = [
        "Paris is the capital of France".split()[:5],
        "Marie Curie was born in Warsaw in the Russian Empire".split()[:9],
    ]
    tokenizer = WordTokenizer([w.lower() for s in sentences for w in s])
    bert = BertModel().eval()
    encoder = BERTSentenceEncoder(bert, tokenizer, max_length=12).eval()
    inputs = collate_fn(encoder, sentences)
    with torch.no_grad():
        x = encoder(inputs)
        # sentence 0 ([CLS] + 5 tokens) encoded without any padding
        _, unpadded = bert(inputs['word'][:1, :6], attention_mask=torch.ones(1, 6, dtype=torch.long))
    print("fixed" if FIXED else "buggy", "mask row 0:", inputs['mask'][0].tolist(),
          "| sentence 0 vs unpadded max diff:", f"{(x[0] - unpadded[0]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()

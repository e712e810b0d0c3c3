# The bug of PixArt-sigma d5adc75 (blind-ea's pixart_sigma_train_null_embed_encoded_with_prompt_mask) written another
# way: a dense-retrieval evaluation encodes a batch of passages, then its batch of queries with the passages'
# attention_mask (both padded on the right to one max_length, so the shapes agree), through a bidirectional BERT.
# The queries are shorter: the passages' mask marks their pad tokens real and each query attends its padding. The fix
# encodes the queries with their own mask.
import sys

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, CLS, SEP, MAX_LEN = 0, 2, 3, 12


def tokenize(texts):
    """Word ids between [CLS] and [SEP], right padded with PAD to MAX_LEN: (input_ids, attention_mask)."""
    rows = [[CLS] + [4 + sum(map(ord, w)) % 90 for w in t.split()][: MAX_LEN - 2] + [SEP] for t in texts]
    ids = torch.tensor([r + [PAD] * (MAX_LEN - len(r)) for r in rows])
    return ids, (ids != PAD).long()


config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
encoder = BertModel(config, add_pooling_layer=False).eval()
passages = ["the river delta floods every spring after snow melts", "granite forms from slowly cooled magma deep down"]
queries = ["when does the delta flood", "what is granite"]

with torch.no_grad():
    passage_ids, passage_mask = tokenize(passages)
    passage_vecs = encoder(input_ids=passage_ids, attention_mask=passage_mask).last_hidden_state[:, 0]
    query_ids, query_mask = tokenize(queries)
    query_vecs = encoder(input_ids=query_ids,
                         attention_mask=query_mask if FIXED else passage_mask).last_hidden_state[:, 0]
    alone = torch.cat([encoder(input_ids=query_ids[i:i + 1, :int(n)]).last_hidden_state[:, 0]
                       for i, n in enumerate(query_mask.sum(dim=1))])
print(f"max |query [CLS] in the batch - query alone| = {(query_vecs - alone).abs().max().item():.6f}")

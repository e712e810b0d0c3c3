"""huggingface/transformers#37429: Llama 4's chunked attention mask for packed sequences clobbered the document ids
with the chunk index, so the information that told documents apart within one chunk was gone and tokens attended
across documents inside a chunk. The fix builds the chunk mask and combines it with the document-causal mask."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
CHUNK = 4


def make_block_causal_mask(position_ids, attention_chunk_size):
    length = position_ids.shape[1]
    document_ids = torch.cumsum(position_ids == 0, dim=1) - 1  # packed: positions restart at each document
    index = torch.arange(length)
    chunk_ids = index // attention_chunk_size
    if FIXED:
        same = (document_ids[:, :, None] == document_ids[:, None, :]) & (chunk_ids[:, None] == chunk_ids[None, :])
    else:
        document_ids = chunk_ids[None, :].expand_as(document_ids)  # the chunk index written over the documents
        same = document_ids[:, :, None] == document_ids[:, None, :]
    return (index[None, :, None] >= index[None, None, :]) & same


class Llama4TextModel(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, position_ids):
        q, k, v = self.qkv(self.embed(input_ids)).unsqueeze(1).chunk(3, dim=-1)
        mask = make_block_causal_mask(position_ids, CHUNK)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


torch.manual_seed(0)
documents = [3, 5]
input_ids = torch.arange(1, 9)[None]
position_ids = torch.tensor([[i for n in documents for i in range(n)]])
with torch.no_grad():
    Llama4TextModel().eval()(input_ids, position_ids)

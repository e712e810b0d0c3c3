"""Perceiver IO decoder with padded OUTPUT queries: the padding mask lies on the query axis, on purpose.

Follows google-deepmind/deepmind-research perceiver/perceiver.py (BasicDecoder: output queries cross-attend
the latent array; the latents are never padded) and the HF port huggingface/transformers
models/perceiver/modeling_perceiver.py (PerceiverBasicDecoder, decoder_query; attention_mask only applies to
the encoder inputs, not to the latents). Recalled, not read line by line. Variable-length targets (e.g. the
characters of words of different lengths, as in Perceiver IO's masked-language decoding) are batched by
padding the output queries.

Mask meant: the keys are the N latents, all real, so no key mask. The query rows for padded output positions
are computed like any other (each query attends the latents independently, so a padded query cannot affect a
real one) and are dropped by the loss mask. The encoder's input keys are padded and masked as usual.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class CrossAttention(nn.Module):
    def __init__(self, q_dim, kv_dim, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(q_dim, d)
        self.kv = nn.Linear(kv_dim, 2 * d)
        self.o = nn.Linear(d, q_dim)

    def forward(self, inputs_q, inputs_kv, attention_mask=None):
        b, n, _ = inputs_q.shape
        q = self.q(inputs_q).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(inputs_kv).view(b, inputs_kv.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return inputs_q + self.o(o.transpose(1, 2).reshape(b, n, -1))


class PerceiverIOLite(nn.Module):
    def __init__(self, vocab=30, num_latents=6, d_latents=32, max_out=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.latents = nn.Parameter(torch.randn(num_latents, d_latents))
        self.encoder = CrossAttention(d_latents, 32)
        self.output_position_encodings = nn.Embedding(max_out, 32)
        self.decoder = CrossAttention(32, d_latents)
        self.to_logits = nn.Linear(32, vocab)

    def forward(self, inputs, attention_mask, num_outputs):
        b = inputs.shape[0]
        z = self.encoder(self.latents.expand(b, -1, -1), self.embed(inputs), attention_mask=attention_mask)
        decoder_query = self.output_position_encodings.weight[:num_outputs].expand(b, -1, -1)
        return self.to_logits(self.decoder(decoder_query, z))  # latents are never padded: no key mask


inputs = torch.tensor([[3, 4, 5, 6, 7, 0, 0], [8, 9, 10, 11, 12, 13, 14]])
attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
labels = [torch.tensor([4, 5, 6]), torch.tensor([9, 10, 11, 12, 13])]
num_outputs = max(len(l) for l in labels)
target = torch.stack([F.pad(l, (0, num_outputs - len(l))) for l in labels])
output_mask = torch.stack([torch.arange(num_outputs) < len(l) for l in labels])  # query-axis padding

model = PerceiverIOLite().eval()
with torch.no_grad():
    logits = model(inputs, attention_mask, num_outputs)
    loss = F.cross_entropy(logits[output_mask], target[output_mask])
    # reference: each sample alone, unpadded input and exactly its own number of output queries
    ref_losses = []
    for i, l in enumerate(labels):
        n = int(attention_mask[i].sum())
        li = model(inputs[i:i + 1, :n], attention_mask[i:i + 1, :n], len(l))
        assert torch.allclose(li[0], logits[i, :len(l)], atol=1e-5)
        ref_losses.append(F.cross_entropy(li[0], l, reduction="sum"))
    ref = torch.stack(ref_losses).sum() / sum(len(l) for l in labels)
    assert torch.allclose(loss, ref, atol=1e-5)
print(f"output queries={num_outputs} real={int(output_mask.sum())} loss={loss.item():.4f} ok")

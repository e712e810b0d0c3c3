# Correct (quiet): a layer whose tokens attend only themselves (its first pass shows no query seeing an earlier key),
# so its one-token step at position 4 needs no cache; then a decoder whose cached steps read a ring cache cut to a
# window of 3 (more keys than queries: the cache reached the kernel).
import torch
import torch.nn.functional as F

torch.manual_seed(0)


class Alone(torch.nn.Module):
    def forward(self, x, position_ids):
        q = k = v = x[:, None]
        alone = torch.eye(x.shape[1], dtype=torch.bool)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=alone)[:, 0]


class Decoder(torch.nn.Module):
    def forward(self, x, position_ids, cache):
        cache.append(x)
        keys = torch.cat(cache, 1)[:, -3:]  # (a window of 3: the ring cache's last keys)
        return F.scaled_dot_product_attention(x[:, None], keys[:, None], keys[:, None],
                                              is_causal=x.shape[1] > 1)[:, 0]


alone, decoder = Alone(), Decoder()
stream = torch.randn(1, 8, 4)
with torch.no_grad():
    alone(stream[:, :4], torch.arange(4)[None])
    alone(stream[:, 4:5], torch.tensor([[4]]))
    cache = []
    decoder(stream[:, :3], torch.arange(3)[None], cache)
    for step in range(3, 6):
        decoder(stream[:, step:step + 1], torch.tensor([[step]]), cache)

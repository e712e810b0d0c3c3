# Follows huggingface/diffusers transformer_2d / PixArtTransformer2DModel.forward (encoder_attention_mask =
# (1 - mask) * -10000.0, unsqueeze(1)) and attention_processor.py Attention.prepare_attention_mask + AttnProcessor
# (baddbmm over batch*heads). 16 image queries cross-attend to <= 6 caption keys; the 1/0 keep-mask becomes a float bias.
import torch

torch.manual_seed(0)
D, H, IMG, TXT = 32, 4, 16, 6
hd = D // H
to_q = torch.nn.Linear(D, D, bias=False).double()
to_k = torch.nn.Linear(D, D, bias=False).double()
to_v = torch.nn.Linear(D, D, bias=False).double()
to_out = torch.nn.Linear(D, D).double()


def head_to_batch_dim(t):
    b, n, _ = t.shape
    return t.view(b, n, H, hd).permute(0, 2, 1, 3).reshape(b * H, n, hd)


def prepare_attention_mask(attention_mask, target_length, batch_size):
    # (b, 1, key_len) -> (b*heads, 1, key_len), repeat_interleave over heads as diffusers does
    current_length = attention_mask.shape[-1]
    assert current_length == target_length
    return attention_mask.repeat_interleave(H, dim=0)


def cross_attention(hidden, encoder_hidden, encoder_attention_mask):
    b = hidden.shape[0]
    q = head_to_batch_dim(to_q(hidden))
    k = head_to_batch_dim(to_k(encoder_hidden))
    v = head_to_batch_dim(to_v(encoder_hidden))
    if encoder_attention_mask is not None:
        bias = (1 - encoder_attention_mask.to(hidden.dtype)) * -10000.0
        bias = bias.unsqueeze(1)
        bias = prepare_attention_mask(bias, k.shape[1], b)
        baddbmm_input = bias
        beta = 1
    else:
        baddbmm_input = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype)
        beta = 0
    scores = torch.baddbmm(baddbmm_input, q, k.transpose(-1, -2), beta=beta, alpha=hd ** -0.5)
    probs = scores.softmax(dim=-1)
    o = torch.bmm(probs, v).view(b, H, -1, hd).permute(0, 2, 1, 3).reshape(b, -1, D)
    return to_out(o)


caption_lens = [6, 2, 4, 1]
B = len(caption_lens)
img = torch.randn(B, IMG, D, dtype=torch.float64)
cap = torch.randn(B, TXT, D, dtype=torch.float64)
keep = torch.zeros(B, TXT, dtype=torch.long)
for i, n in enumerate(caption_lens):
    keep[i, :n] = 1
y = cross_attention(img, cap, keep)

diff = 0.0
for i, n in enumerate(caption_lens):
    ref = cross_attention(img[i:i + 1], cap[i:i + 1, :n], None)
    diff = max(diff, (y[i] - ref[0]).abs().max().item())
print("max |padded captions with -10000 bias - each caption unpadded| =", diff)
assert diff < 1e-12

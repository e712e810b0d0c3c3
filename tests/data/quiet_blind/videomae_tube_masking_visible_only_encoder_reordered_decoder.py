# MCG-NJU/VideoMAE (masking_generator.py TubeMaskingGenerator; modeling_pretrain.py PretrainVisionTransformer.forward):
# the same spatial mask is repeated over every temporal slice (True = masked), the encoder sees only x[~mask], and the
# decoder gets [visible ; mask tokens] in that reordered order and keeps the last num_masked rows for the loss.
import torch
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
B, T, HW, C, RATIO = 2, 4, 9, 32, 0.66   # 4 temporal slices (tubelet 2) x 3x3 patches
N = T * HW

def tube_mask(rng):
    num_masks = int(RATIO * HW)
    m = torch.zeros(HW, dtype=torch.bool); m[torch.randperm(HW, generator=rng)[:num_masks]] = True
    return m.repeat(T)  # np.tile(mask_per_frame, (frames, 1)).flatten()

def block(dim):
    return torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True).eval()
encoder, decoder = block(C), block(C)
enc_to_dec = torch.nn.Linear(C, C, bias=False)
mask_token = torch.nn.Parameter(torch.randn(1, 1, C))
pos = torch.randn(1, N, C)
x = torch.randn(B, N, C) + pos
rng = torch.Generator().manual_seed(1)
mask = torch.stack([tube_mask(rng) for _ in range(B)])

with torch.no_grad():
    # VideoMAE: gather visible, encode, append mask tokens after them
    x_vis = encoder(x[~mask].reshape(B, -1, C))
    x_vis = enc_to_dec(x_vis)
    expand_pos = pos.expand(B, -1, -1)
    pos_vis = expand_pos[~mask].reshape(B, -1, C); pos_mask = expand_pos[mask].reshape(B, -1, C)
    x_full = torch.cat([x_vis + pos_vis, mask_token + pos_mask], dim=1)
    n_masked = pos_mask.shape[1]
    pred = decoder(x_full)[:, -n_masked:]
    # reference: original token order, masked tokens removed as keys via key_padding_mask (True = ignore)
    enc_ref = encoder(x, src_key_padding_mask=mask)
    dec_in = torch.where(mask[..., None], mask_token + pos, enc_to_dec(enc_ref) + pos)
    dec_ref = decoder(dec_in)
    ref = torch.stack([dec_ref[b][mask[b]] for b in range(B)])
    diff = (pred - ref).abs().max().item()
    print("max diff tube-masked visible-only encoder + reordered decoder vs key-masked full order:", diff)
    assert diff < 1e-10

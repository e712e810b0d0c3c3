# Citation: huggingface/transformers src/transformers/models/videomae/modeling_videomae.py (as installed, v5.25.0:
#   VideoMAEEmbeddings.forward keeps `embeddings[~bool_masked_pos]`, VideoMAEForPreTraining.forward appends
#   mask tokens with the masked patches' position embeddings and reconstructs the masked patches,
#   norm_pix_loss labels `videos_patch[bool_masked_pos]`), with the tube masks of MCG-NJU/VideoMAE
#   masking_generator.py (TubeMaskingGenerator: one shuffled per-frame mask tiled over the temporal patches,
#   the same count masked in every video) stacked by a collate into a (batch, seq_len) bool_masked_pos.
# Tiny VideoMAEConfig, random weights, eval mode. Two videos with different tube masks in one batch.
# Self-check: (1) each video's logits equal the video run alone with its own mask; (2) the logits equal a
#   per-video loop that picks the visible patches by index, runs the encoder, builds [visible + pos ;
#   mask_token + pos] by hand and runs the decoder; (3) the loss equals a double loop over videos and masked
#   patches, with each label patch cut out of the video by slicing (t, y, x) and normalised by hand.
import numpy as np
import torch
from transformers import VideoMAEConfig, VideoMAEForPreTraining
from transformers.models.videomae.modeling_videomae import get_sinusoid_encoding_table

torch.manual_seed(0)
np.random.seed(0)


class TubeMaskingGenerator:
    def __init__(self, input_size, mask_ratio):
        self.frames, self.height, self.width = input_size
        self.num_patches_per_frame = self.height * self.width
        self.total_patches = self.frames * self.num_patches_per_frame
        self.num_masks_per_frame = int(mask_ratio * self.num_patches_per_frame)
        self.total_masks = self.frames * self.num_masks_per_frame

    def __call__(self):
        mask_per_frame = np.hstack([
            np.zeros(self.num_patches_per_frame - self.num_masks_per_frame),
            np.ones(self.num_masks_per_frame),
        ])
        np.random.shuffle(mask_per_frame)
        mask = np.tile(mask_per_frame, (self.frames, 1)).flatten()
        return mask


config = VideoMAEConfig(
    image_size=32, patch_size=8, num_channels=3, num_frames=4, tubelet_size=2,
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    decoder_hidden_size=32, decoder_num_hidden_layers=2, decoder_num_attention_heads=4,
    decoder_intermediate_size=64, norm_pix_loss=True, use_mean_pooling=False,
)
model = VideoMAEForPreTraining(config).eval()

T, P, ts = config.num_frames, config.patch_size, config.tubelet_size
grid = (T // ts, config.image_size // P, config.image_size // P)
masking = TubeMaskingGenerator(grid, mask_ratio=0.75)
seq_len = grid[0] * grid[1] * grid[2]

batch_size = 2
pixel_values = torch.randn(batch_size, T, 3, config.image_size, config.image_size)
bool_masked_pos = torch.stack([torch.from_numpy(masking()) for _ in range(batch_size)]).bool()
assert not torch.equal(bool_masked_pos[0], bool_masked_pos[1])

with torch.no_grad():
    out = model(pixel_values, bool_masked_pos=bool_masked_pos)
    alone = [model(pixel_values[b:b + 1], bool_masked_pos=bool_masked_pos[b:b + 1]) for b in range(batch_size)]

# (1) batch independence
for b in range(batch_size):
    diff = (out.logits[b] - alone[b].logits[0]).abs().max().item()
    assert diff < 1e-5, (b, diff)

# (2) per-video loop over visible / masked indices
enc_pos = get_sinusoid_encoding_table(seq_len, config.hidden_size)[0]
dec_pos = get_sinusoid_encoding_table(seq_len, config.decoder_hidden_size)[0]
with torch.no_grad():
    for b in range(batch_size):
        visible = [i for i in range(seq_len) if not bool_masked_pos[b, i]]
        masked = [i for i in range(seq_len) if bool_masked_pos[b, i]]
        patches = model.videomae.embeddings.patch_embeddings(pixel_values[b:b + 1])[0] + enc_pos
        h = patches[visible][None]
        for layer in model.videomae.encoder.layer:
            h = layer(h)
            h = h[0] if isinstance(h, tuple) else h
        if model.videomae.layernorm is not None:
            h = model.videomae.layernorm(h)
        h = model.encoder_to_decoder(h)[0]
        x_full = torch.cat([h + dec_pos[visible], model.mask_token[0] + dec_pos[masked]], dim=0)[None]
        ref_logits = model.decoder(x_full, len(masked)).logits[0]
        diff = (out.logits[b] - ref_logits).abs().max().item()
        assert diff < 1e-5, (b, diff)

# (3) loss by a double loop over videos and masked patches
mean = torch.tensor([0.485, 0.456, 0.406])[None, :, None, None]
std = torch.tensor([0.229, 0.224, 0.225])[None, :, None, None]
sq, count = 0.0, 0
for b in range(batch_size):
    frames = pixel_values[b] * std + mean
    j = 0
    for i in range(seq_len):
        if not bool_masked_pos[b, i]:
            continue
        t, rem = divmod(i, grid[1] * grid[2])
        y, x = divmod(rem, grid[2])
        cube = frames[t * ts:(t + 1) * ts, :, y * P:(y + 1) * P, x * P:(x + 1) * P]  # (ts, C, P, P)
        cube = cube.permute(0, 2, 3, 1).reshape(ts * P * P, 3)
        cube = (cube - cube.mean(0, keepdim=True)) / (cube.var(0, unbiased=True, keepdim=True).sqrt() + 1e-6)
        label = cube.reshape(-1)
        sq += ((out.logits[b, j] - label) ** 2).sum().item()
        count += label.numel()
        j += 1
    assert j == out.logits.shape[1]
ref_loss = sq / count
assert abs(out.loss.item() - ref_loss) < 1e-4, (out.loss.item(), ref_loss)
print("ok: VideoMAE tube-masked pretraining matches per-video loops", out.loss.item())

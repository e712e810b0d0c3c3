# huggingface/lerobot#4153 (fixed by #4381): VLA-JEPA's world-model loss encodes the whole clip in one
# bidirectional V-JEPA2 pass and slices the context positions out of it, so the predictor's context
# already attends to the future frames it must predict. Fix: encode each context position from its own prefix.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import VJEPA2Config, VJEPA2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VLAJEPAConfig:
    num_video_frames = 8  # raw frames per clip
    num_action_tokens_per_timestep = 1
    causal_world_model_context = FIXED  # opt-in flag added by the fix


class ActionConditionedVideoPredictor(nn.Module):
    def __init__(self, embed_dim, action_embed_dim):
        super().__init__()
        self.action_proj = nn.Linear(action_embed_dim, embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 2 * embed_dim), nn.GELU(), nn.Linear(2 * embed_dim, embed_dim))

    def forward(self, input_states, action_tokens):
        b, n, d = input_states.shape
        t = action_tokens.shape[1]
        act = self.action_proj(action_tokens).repeat_interleave(n // t, dim=1)
        return input_states + self.mlp(input_states + act)


class VLAJEPAModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        enc_cfg = VJEPA2Config(
            crop_size=32, frames_per_clip=8, tubelet_size=2, patch_size=16, hidden_size=32,
            num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0,
            pred_hidden_size=32, pred_num_hidden_layers=1, pred_num_attention_heads=2,
        )
        enc_cfg._attn_implementation = "sdpa"
        self.video_encoder = VJEPA2Model(enc_cfg).eval()
        self.video_predictor = ActionConditionedVideoPredictor(32, 16)

    def _causal_video_embeddings(self, video_pixels, num_positions, tubelet_size):
        """Encode each leading temporal position from only its own raw-frame prefix."""
        positions = []
        for position in range(num_positions):
            prefix = self.video_encoder.get_vision_features(
                pixel_values_videos=video_pixels[:, : (position + 1) * tubelet_size]
            )
            tokens_per_frame = prefix.shape[1] // (position + 1)
            positions.append(prefix[:, position * tokens_per_frame:])
        return torch.cat(positions, dim=1)

    def _world_model_loss(self, video_pixels, action_tokens):
        tubelet_size = self.video_encoder.config.tubelet_size
        t_enc_total = self.config.num_video_frames // tubelet_size
        t_enc_ctx = t_enc_total - 1
        with torch.no_grad():
            video_embeddings = self.video_encoder.get_vision_features(pixel_values_videos=video_pixels)
            tokens_per_frame = video_embeddings.shape[1] // t_enc_total
            # Shift-by-one JEPA split: input_states = positions 0..T-2, gt_states = positions 1..T-1
            if self.config.causal_world_model_context:
                input_states = self._causal_video_embeddings(video_pixels, t_enc_ctx, tubelet_size)
            else:
                input_states = video_embeddings[:, : tokens_per_frame * t_enc_ctx, :]
            gt_states = video_embeddings[:, tokens_per_frame:, :]
        predicted_states = self.video_predictor(input_states, action_tokens[:, :t_enc_ctx])
        return F.l1_loss(predicted_states, gt_states), input_states


model = VLAJEPAModel(VLAJEPAConfig())
video = torch.rand(2, 8, 3, 32, 32)
actions = torch.randn(2, 3, 16)
loss, ctx = model._world_model_loss(video, actions)

# perturb only the last tubelet (raw frames 6..7): the context (positions 0..2) must not change
video2 = video.clone()
video2[:, 6:] = torch.rand_like(video2[:, 6:])
_, ctx2 = model._world_model_loss(video2, actions)
leak = (ctx - ctx2).abs().max().item()
print(f"fixed={FIXED} wm_loss={loss.item():.4f} context change from future frames = {leak:.3e}")

# Tsinghua-MARS-Lab/StateTransformer#93 (commit 34d136b): generate() zeroed the attention mask over the future
# trajectory slots, so at inference they were hidden keys although training attended to them with an all-ones mask.
import sys

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GPTNonAutoRegressiveModelNuplan(nn.Module):
    def __init__(self, config, in_channels=4, ar_future_interval=4, k=1):
        super().__init__()
        self.transformer = GPT2Model(config)
        n_embed = config.n_embd // 2
        # stand-in for CNNDownSamplingResNet18: one strided conv + pooling per raster
        self.cnn_downsample = nn.Sequential(nn.Conv2d(in_channels, 8, 3, stride=2), nn.ReLU(),
                                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, n_embed))
        self.action_m_embed = nn.Sequential(nn.Linear(4, config.n_embd), nn.Tanh())
        self.traj_decoder = nn.Sequential(nn.Linear(config.n_embd, 32), nn.ReLU(), nn.Linear(32, 4))
        self.key_points_decoder = nn.Sequential(nn.Linear(config.n_embd, 32), nn.ReLU(), nn.Linear(32, 2))
        self.ar_future_interval = ar_future_interval
        self.k = k

    def _prepare_position_ids_for_generation(self, attention_mask):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        return position_ids

    @torch.no_grad()
    def generate(self, high_res_raster, low_res_raster, context_actions, pred_length):
        device = high_res_raster.device
        action_embeds = self.action_m_embed(context_actions)
        batch_size, context_length, c, h, w = high_res_raster.shape
        high_res_embed = self.cnn_downsample(high_res_raster.reshape(batch_size * context_length, c, h, w))
        low_res_embed = self.cnn_downsample(low_res_raster.reshape(batch_size * context_length, c, h, w))
        high_res_embed = high_res_embed.reshape(batch_size, context_length, -1)
        low_res_embed = low_res_embed.reshape(batch_size, context_length, -1)
        state_embeds = torch.cat((high_res_embed, low_res_embed), dim=-1).to(torch.float32)
        n_embed = action_embeds.shape[-1]
        input_embeds = torch.zeros((batch_size, context_length * 2, n_embed), dtype=torch.float32, device=device)
        input_embeds[:, ::2, :] = state_embeds
        input_embeds[:, 1::2, :] = action_embeds

        trajectory_label_dummy = torch.zeros((batch_size, pred_length, 4), device=device)
        future_key_points = trajectory_label_dummy[:, self.ar_future_interval - 1::self.ar_future_interval, :]
        future_key_embeds_dummy = self.action_m_embed(future_key_points)
        input_embeds = torch.cat([input_embeds, future_key_embeds_dummy,
                                  torch.zeros((batch_size, pred_length, n_embed), device=device)], dim=1)
        key_points_num = future_key_points.shape[1]
        # autoregressive key points, each step on the prefix only
        for i in range(key_points_num):
            input_embeds_current = input_embeds[:, :context_length * 2 + i, :]
            attention_mask = torch.ones(input_embeds_current.shape[:2], dtype=torch.long, device=device)
            position_ids = self._prepare_position_ids_for_generation(attention_mask.clone())
            transformer_output = self.transformer(inputs_embeds=input_embeds_current, attention_mask=attention_mask,
                                                  position_ids=position_ids)
            hidden = transformer_output["last_hidden_state"][:, context_length * 2 + i - 1, :].reshape(batch_size, 1, -1)
            key_points_logit = self.key_points_decoder(hidden).reshape(batch_size, 1, -1)
            pred_key_point = torch.zeros((batch_size, 1, 4), device=device)
            pred_key_point[:, 0, :2] = key_points_logit[:, 0, :]
            key_point_embed = self.action_m_embed(pred_key_point).reshape(batch_size, 1, -1)
            input_embeds[:, context_length * 2 + i, :] = key_point_embed[:, 0, :]
        # generate remaining trajectory in one non-autoregressive pass
        attention_mask = torch.ones((input_embeds.shape[0], input_embeds.shape[1]), device=device)
        if not FIXED:
            attention_mask[:, context_length * 2 + key_points_num:] = 0
        transformer_output = self.transformer(inputs_embeds=input_embeds, attention_mask=attention_mask,
                                              position_ids=None)
        transformer_outputs_hidden_state = transformer_output["last_hidden_state"]
        traj_hidden_state = transformer_outputs_hidden_state[:, -pred_length - 1:-1, :]
        traj_logits = self.traj_decoder(traj_hidden_state)
        future_key_points_hidden_state = transformer_outputs_hidden_state[
            :, context_length * 2 - 1:context_length * 2 + key_points_num - 1, :]
        key_points_logits = self.key_points_decoder(future_key_points_hidden_state)
        return torch.cat([key_points_logits, traj_logits[..., :2]], dim=1), traj_logits, input_embeds


def main():
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=8, bos_token_id=0, eos_token_id=0)
    model = GPTNonAutoRegressiveModelNuplan(config).eval()
    batch_size, context_length, pred_length = 2, 4, 8
    high_res_raster = torch.rand(batch_size, context_length, 4, 16, 16)
    low_res_raster = torch.rand(batch_size, context_length, 4, 16, 16)
    context_actions = torch.randn(batch_size, context_length, 4)

    _, traj, input_embeds = model.generate(high_res_raster, low_res_raster, context_actions, pred_length)
    # the training forward pass attends over the whole sequence with an all-ones mask
    with torch.no_grad():
        hidden = model.transformer(inputs_embeds=input_embeds,
                                   attention_mask=torch.ones(input_embeds.shape[:2])).last_hidden_state
        traj_train = model.traj_decoder(hidden[:, -pred_length - 1:-1, :])
    print("fixed" if FIXED else "buggy", "trajectory max |generate - training-style forward|",
          round((traj - traj_train).abs().max().item(), 6))


if __name__ == "__main__":
    main()

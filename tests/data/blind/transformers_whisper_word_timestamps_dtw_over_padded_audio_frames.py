# huggingface/transformers#25607 (merged), "[Whisper] Fix word-level timestamps for audio < 30 seconds".
# Bug: WhisperForConditionalGeneration._extract_token_timestamps normalised, median-filtered and DTW-aligned the
# alignment heads' cross-attention over every encoder frame of the padded 30 s window, so the DTW path of a short
# clip runs on into the silent padding and the tokens' times are stretched over audio that is not there.
# Fix: the pipeline passes `num_frames` (the clip's real mel frames, stride[0] // hop_length), generate keeps it in
# the generation config and the cross-attention is cropped to `num_frames // 2` encoder frames before DTW.
# (Fixed form as it reads in modeling_whisper.py after the PR; the model is built tiny from its config.)
import sys

import numpy as np
import torch
from torch import nn
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.generation.utils import GenerateEncoderDecoderOutput

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _median_filter(inputs: torch.Tensor, filter_width: int) -> torch.Tensor:
    if filter_width <= 0 or filter_width % 2 != 1:
        raise ValueError("`filter_width` should be an odd number")
    pad_width = filter_width // 2
    if inputs.shape[-1] <= pad_width:
        return inputs
    inputs = nn.functional.pad(inputs, (pad_width, pad_width, 0, 0), mode="reflect")
    return inputs.unfold(-1, filter_width, 1).sort()[0][..., pad_width]


def _dynamic_time_warping(matrix: np.ndarray):
    output_length, input_length = matrix.shape
    cost = np.ones((output_length + 1, input_length + 1), dtype=np.float32) * np.inf
    trace = -np.ones((output_length + 1, input_length + 1), dtype=np.float32)
    cost[0, 0] = 0
    for j in range(1, input_length + 1):
        for i in range(1, output_length + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = matrix[i - 1, j - 1] + c
            trace[i, j] = t
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    trace[0, :] = 2
    trace[:, 0] = 1
    text_indices, time_indices = [], []
    while i > 0 or j > 0:
        text_indices.append(i - 1)
        time_indices.append(j - 1)
        if trace[i, j] == 0:
            i -= 1
            j -= 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text_indices)[::-1], np.array(time_indices)[::-1]


class WhisperWithTimestamps(WhisperForConditionalGeneration):
    def _extract_token_timestamps(self, generate_outputs, alignment_heads, time_precision=0.02, num_frames=None):
        # (batch size, attention_heads, output length, input length) per decoder layer
        cross_attentions = []
        for i in range(self.config.decoder_layers):
            cross_attentions.append(torch.cat([x[i] for x in generate_outputs.cross_attentions], dim=2))
        weights = torch.stack([cross_attentions[l][:, h] for l, h in alignment_heads])
        weights = weights.permute([1, 0, 2, 3])
        if num_frames is not None:
            weights = weights[..., : num_frames // 2]

        std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
        weights = (weights - mean) / std
        weights = _median_filter(weights, self.config.median_filter_width)
        matrix = weights.mean(dim=1)

        timestamps = torch.zeros_like(generate_outputs.sequences, dtype=torch.float32)
        for batch_idx in range(timestamps.shape[0]):
            text_indices, time_indices = _dynamic_time_warping(-matrix[batch_idx].double().cpu().numpy())
            jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
            jump_times = time_indices[jumps] * time_precision
            timestamps[batch_idx, 1:] = torch.tensor(jump_times)
        return timestamps

    @torch.no_grad()
    def generate(self, input_features, decoder_input_ids, max_new_tokens, return_token_timestamps=False, **kwargs):
        generation_config = self.generation_config
        if return_token_timestamps and FIXED and kwargs.get("num_frames") is not None:
            generation_config.num_frames = kwargs.pop("num_frames")

        encoder_outputs = self.get_encoder()(input_features)
        sequences, past, step_inputs, cross = decoder_input_ids, None, decoder_input_ids, []
        for _ in range(max_new_tokens):
            out = self(encoder_outputs=encoder_outputs, decoder_input_ids=step_inputs, cache=past,
                       use_cache=True, output_attentions=return_token_timestamps)
            past = out.cache
            cross.append(out.cross_attentions)
            step_inputs = out.logits[:, -1:].argmax(-1)
            sequences = torch.cat([sequences, step_inputs], dim=-1)
        outputs = GenerateEncoderDecoderOutput(sequences=sequences, cross_attentions=tuple(cross))

        if return_token_timestamps and hasattr(generation_config, "alignment_heads"):
            if FIXED:
                num_frames = getattr(generation_config, "num_frames", None)
                outputs["token_timestamps"] = self._extract_token_timestamps(
                    outputs, generation_config.alignment_heads, num_frames=num_frames
                )
            else:
                outputs["token_timestamps"] = self._extract_token_timestamps(
                    outputs, generation_config.alignment_heads
                )
        return outputs


config = WhisperConfig(
    vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    max_source_positions=100, max_target_positions=32, pad_token_id=0, decoder_start_token_id=1,
    eos_token_id=2, bos_token_id=1, median_filter_width=7,
)
config._attn_implementation = "eager"
model = WhisperWithTimestamps(config).eval()
model.generation_config.alignment_heads = [[0, 1], [1, 0], [1, 3]]

# One clip of 96 mel frames (0.96 s) in the padded 200-frame window; the feature extractor pads the waveform
# with zeros, whose log-mel sits on the clamp floor.
hop_length, n_window = 160, 2 * config.max_source_positions
clip_frames = 96
log_spec = torch.randn(1, config.num_mel_bins, n_window)
floor = log_spec[..., :clip_frames].max() - 8.0 / 4.0
log_spec[..., clip_frames:] = floor
stride = (clip_frames * hop_length, 0, 0)  # the pipeline's (chunk_len, left, right) in samples

generate_kwargs = {"return_token_timestamps": True}
if FIXED:
    generate_kwargs["num_frames"] = stride[0] // hop_length
prompt = torch.tensor([[1, 3, 4]])
out = model.generate(log_spec, prompt, max_new_tokens=8, **generate_kwargs)
print("tokens:", out.sequences[0].tolist())
print("token_timestamps:", [round(t, 2) for t in out["token_timestamps"][0].tolist()])

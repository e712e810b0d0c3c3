"""Mochi 1 joint attention: per-sample selection of the valid T5 prompt tokens, SDPA without a mask, outputs
padded back with zeros.

Follows huggingface/diffusers, src/diffusers/models/transformers/transformer_mochi.py and
src/diffusers/models/attention_processor.py, MochiAttnProcessor2_0.__call__:
      for idx in range(batch_size):
          mask = attention_mask[idx][None, :]
          valid_prompt_token_indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
          valid_encoder_query = encoder_query[idx : idx + 1, :, valid_prompt_token_indices, :]
          ...
          valid_query = torch.cat([query[idx : idx + 1], valid_encoder_query], dim=2)
          attn_output = F.scaled_dot_product_attention(valid_query, valid_key, valid_value, dropout_p=0.0, is_causal=False)
          attn_output = F.pad(attn_output, (0, 0, 0, total_length - valid_sequence_length))
  with hidden_states, encoder_hidden_states = hidden_states.split_with_sizes((sequence_length, encoder_sequence_length), dim=1)
  and the encoder_attention_mask is the T5 tokenizer's padding mask of the prompt (pipeline_mochi.py).
Video tokens and the prompt's real tokens attend to each other fully; the prompt's padding takes no part.
Reduced: one joint block (separate q/k/v for the two streams, qk RMSNorm), float64.
Check against a second form: one batched SDPA over [video, prompt] with a boolean key mask from the same
padding mask; video rows and valid prompt rows agree, padded prompt rows are zero in Mochi's form.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

B, N_VID, N_TXT, D, D_TXT, HEADS = 3, 12, 8, 32, 24, 4
HD = D // HEADS


def rms(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


to_q, to_k, to_v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
add_q, add_k, add_v = nn.Linear(D_TXT, D), nn.Linear(D_TXT, D), nn.Linear(D_TXT, D)
to_out, to_add_out = nn.Linear(D, D), nn.Linear(D, D_TXT)

hidden_states = torch.randn(B, N_VID, D)
prompt_lengths = torch.tensor([8, 3, 5])
encoder_attention_mask = (torch.arange(N_TXT)[None] < prompt_lengths[:, None]).long()  # T5 padding mask
encoder_hidden_states = torch.randn(B, N_TXT, D_TXT)  # T5 outputs at pad positions are not zero


def heads(x):
    return x.unflatten(2, (HEADS, HD)).transpose(1, 2)


with torch.no_grad():
    query, key, value = rms(heads(to_q(hidden_states))), rms(heads(to_k(hidden_states))), heads(to_v(hidden_states))
    encoder_query = rms(heads(add_q(encoder_hidden_states)))
    encoder_key = rms(heads(add_k(encoder_hidden_states)))
    encoder_value = heads(add_v(encoder_hidden_states))

    sequence_length, encoder_sequence_length = query.size(2), encoder_query.size(2)
    total_length = sequence_length + encoder_sequence_length
    attn_outputs = []
    for idx in range(B):
        mask = encoder_attention_mask[idx][None, :]
        valid_prompt_token_indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        valid_encoder_query = encoder_query[idx:idx + 1, :, valid_prompt_token_indices, :]
        valid_encoder_key = encoder_key[idx:idx + 1, :, valid_prompt_token_indices, :]
        valid_encoder_value = encoder_value[idx:idx + 1, :, valid_prompt_token_indices, :]
        valid_query = torch.cat([query[idx:idx + 1], valid_encoder_query], dim=2)
        valid_key = torch.cat([key[idx:idx + 1], valid_encoder_key], dim=2)
        valid_value = torch.cat([value[idx:idx + 1], valid_encoder_value], dim=2)
        attn_output = F.scaled_dot_product_attention(valid_query, valid_key, valid_value, dropout_p=0.0, is_causal=False)
        valid_sequence_length = attn_output.size(2)
        attn_output = F.pad(attn_output, (0, 0, 0, total_length - valid_sequence_length))
        attn_outputs.append(attn_output)
    hs = torch.cat(attn_outputs, dim=0).transpose(1, 2).flatten(2, 3)
    vid_out, txt_out = hs.split_with_sizes((sequence_length, encoder_sequence_length), dim=1)
    vid_out, txt_out = to_out(vid_out), to_add_out(txt_out)

    # second form: batched joint attention, keys masked by the prompt padding mask
    q = torch.cat([query, encoder_query], 2)
    k = torch.cat([key, encoder_key], 2)
    v = torch.cat([value, encoder_value], 2)
    key_keep = torch.cat([torch.ones(B, N_VID, dtype=torch.bool), encoder_attention_mask.bool()], 1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=key_keep[:, None, None, :])
    ref = ref.transpose(1, 2).flatten(2, 3)
    ref_vid, ref_txt = to_out(ref[:, :N_VID]), ref[:, N_VID:]

d_vid = (vid_out - ref_vid).abs().max().item()
d_txt = 0.0
for idx, n in enumerate(prompt_lengths.tolist()):
    # Mochi's valid prompt rows sit right after the video rows in valid-token order (right padding: same order)
    d_txt = max(d_txt, (txt_out[idx, :n] - to_add_out(ref_txt[idx, :n])).abs().max().item())
    # padded prompt rows: attention output zero-padded, so only the out-proj bias remains
    assert torch.allclose(txt_out[idx, n:], to_add_out.bias.expand(N_TXT - n, -1))
print(f"max |per-sample valid-token SDPA - key-masked joint SDPA|: video {d_vid:.3e}, prompt {d_txt:.3e}")
assert d_vid < 1e-10 and d_txt < 1e-10

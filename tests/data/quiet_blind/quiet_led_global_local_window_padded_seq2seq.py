"""LED (Longformer-Encoder-Decoder) on a right-padded batch: sliding-window local attention with
a different window per encoder layer, global attention on the first token of each source, the
source padded internally to a multiple of the largest window, a causal + padding decoder mask,
and cross-attention over the padded encoder memory.

Uses huggingface/transformers src/transformers/models/led/modeling_led.py (LEDEncoder.forward:
_pad_to_window_size with max(attention_window), _merge_to_attention_mask(attention_mask,
global_attention_mask) = attention_mask * (global_attention_mask + 1), is_index_masked /
is_index_global_attn / is_global_attn handed to LEDEncoderSelfAttention; the output sliced
back to the unpadded length; LEDDecoder causal mask combined with decoder_attention_mask;
encoder_attention_mask expanded for cross-attention), as used by e.g.
allenai/longformer's summarization recipe: global_attention_mask[:, 0] = 1.
A tiny LEDConfig model is built from scratch (no download).

Masking: padded source tokens (right side) are never read by local or global attention; token
0 of each source attends everything and is attended by everything; every other token attends
+-window/2 neighbours (window 4 in layer 0, 8 in layer 1); decoder positions are causal and
never read padded decoder tokens; cross-attention never reads padded encoder positions.
Check: every example run alone, unpadded (LED then pads only up to its own window multiple),
gives the same encoder and decoder states on its real tokens.
"""
import torch
from transformers import LEDConfig, LEDModel

torch.manual_seed(0)


def main():
    cfg = LEDConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32,
        attention_window=[4, 8], max_encoder_position_embeddings=64, max_decoder_position_embeddings=32,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    model = LEDModel(cfg).eval()

    src_lens = [19, 11, 6]
    tgt_lens = [5, 3, 6]
    S, T = max(src_lens), max(tgt_lens)
    B = len(src_lens)
    input_ids = torch.full((B, S), cfg.pad_token_id)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    dec_ids = torch.full((B, T), cfg.pad_token_id)
    dec_mask = torch.zeros(B, T, dtype=torch.long)
    srcs, tgts = [], []
    for b, (ls, lt) in enumerate(zip(src_lens, tgt_lens)):
        s = torch.randint(3, cfg.vocab_size, (ls,))
        s[0], s[-1] = cfg.bos_token_id, cfg.eos_token_id
        t = torch.randint(3, cfg.vocab_size, (lt,))
        t[0] = cfg.decoder_start_token_id
        input_ids[b, :ls], attention_mask[b, :ls] = s, 1
        dec_ids[b, :lt], dec_mask[b, :lt] = t, 1
        srcs.append(s)
        tgts.append(t)
    global_attention_mask = torch.zeros_like(attention_mask)
    global_attention_mask[:, 0] = 1          # <s> of every source is global

    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    global_attention_mask=global_attention_mask,
                    decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask)
        ok = True
        for b in range(B):
            ls, lt = src_lens[b], tgt_lens[b]
            one = model(input_ids=srcs[b][None], attention_mask=torch.ones(1, ls, dtype=torch.long),
                        global_attention_mask=torch.nn.functional.one_hot(torch.tensor([0]), ls),
                        decoder_input_ids=tgts[b][None], decoder_attention_mask=torch.ones(1, lt, dtype=torch.long))
            de = (out.encoder_last_hidden_state[b, :ls] - one.encoder_last_hidden_state[0]).abs().max().item()
            dd = (out.last_hidden_state[b, :lt] - one.last_hidden_state[0]).abs().max().item()
            ok &= de < 1e-4 and dd < 1e-4
            print(f"example {b}: src {ls}/{S} tgt {lt}/{T}  encoder |diff| {de:.2e}  decoder |diff| {dd:.2e}")
        ok &= bool(torch.isfinite(out.last_hidden_state).all())
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()

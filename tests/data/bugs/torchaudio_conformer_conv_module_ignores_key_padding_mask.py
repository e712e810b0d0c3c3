# torchaudio (pytorch/audio#4205, fix PR pytorch/audio#4206): torchaudio.models.Conformer masks padded frames only in
# self-attention (key_padding_mask); _ConvolutionModule ignores it, so padded frames leak into valid ones via the depthwise conv.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _lengths_to_padding_mask(lengths: torch.Tensor) -> torch.Tensor:
    batch_size = lengths.shape[0]
    max_length = int(torch.max(lengths).item())
    padding_mask = torch.arange(max_length, device=lengths.device, dtype=lengths.dtype).expand(
        batch_size, max_length
    ) >= lengths.unsqueeze(1)
    return padding_mask


class _ConvolutionModule(torch.nn.Module):
    def __init__(self, input_dim, num_channels, depthwise_kernel_size, dropout=0.0, bias=False,
                 use_group_norm=False, conv_mask_padding=False):
        super().__init__()
        self.conv_mask_padding = conv_mask_padding
        self.layer_norm = torch.nn.LayerNorm(input_dim)
        self.pointwise_glu = torch.nn.Sequential(
            torch.nn.Conv1d(input_dim, 2 * num_channels, 1, stride=1, padding=0, bias=bias),
            torch.nn.GLU(dim=1),
        )
        self.depthwise = torch.nn.Sequential(
            torch.nn.Conv1d(num_channels, num_channels, depthwise_kernel_size, stride=1,
                            padding=(depthwise_kernel_size - 1) // 2, groups=num_channels, bias=bias),
            torch.nn.GroupNorm(num_groups=1, num_channels=num_channels) if use_group_norm
            else torch.nn.BatchNorm1d(num_channels),
            torch.nn.SiLU(),
            torch.nn.Conv1d(num_channels, input_dim, kernel_size=1, stride=1, padding=0, bias=bias),
            torch.nn.Dropout(dropout),
        )

    def forward(self, input, padding_mask=None):
        x = self.layer_norm(input)
        x = x.transpose(1, 2)
        x = self.pointwise_glu(x)
        if self.conv_mask_padding and padding_mask is not None:
            # (B, T) -> (B, 1, T): zero padded steps right before the depthwise convolution
            x = x.masked_fill(padding_mask.unsqueeze(1), 0.0)
        x = self.depthwise(x)
        return x.transpose(1, 2)


class _FeedForwardModule(torch.nn.Module):
    def __init__(self, input_dim, hidden_dim, dropout=0.0):
        super().__init__()
        self.sequential = torch.nn.Sequential(
            torch.nn.LayerNorm(input_dim), torch.nn.Linear(input_dim, hidden_dim, bias=True), torch.nn.SiLU(),
            torch.nn.Dropout(dropout), torch.nn.Linear(hidden_dim, input_dim, bias=True), torch.nn.Dropout(dropout))

    def forward(self, input):
        return self.sequential(input)


class ConformerLayer(torch.nn.Module):
    def __init__(self, input_dim, ffn_dim, num_attention_heads, depthwise_conv_kernel_size, dropout=0.0,
                 use_group_norm=False, convolution_first=False, conv_mask_padding=False):
        super().__init__()
        self.ffn1 = _FeedForwardModule(input_dim, ffn_dim, dropout=dropout)
        self.self_attn_layer_norm = torch.nn.LayerNorm(input_dim)
        self.self_attn = torch.nn.MultiheadAttention(input_dim, num_attention_heads, dropout=dropout)
        self.self_attn_dropout = torch.nn.Dropout(dropout)
        self.conv_module = _ConvolutionModule(input_dim, input_dim, depthwise_conv_kernel_size, dropout=dropout,
                                              bias=True, use_group_norm=use_group_norm,
                                              conv_mask_padding=conv_mask_padding)
        self.ffn2 = _FeedForwardModule(input_dim, ffn_dim, dropout=dropout)
        self.final_layer_norm = torch.nn.LayerNorm(input_dim)
        self.convolution_first = convolution_first

    def _apply_convolution(self, input, key_padding_mask=None):
        residual = input
        input = input.transpose(0, 1)
        input = self.conv_module(input, key_padding_mask)
        input = input.transpose(0, 1)
        return residual + input

    def forward(self, input, key_padding_mask):
        residual = input
        x = self.ffn1(input)
        x = x * 0.5 + residual
        if self.convolution_first:
            x = self._apply_convolution(x, key_padding_mask)
        residual = x
        x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=key_padding_mask, need_weights=False)
        x = self.self_attn_dropout(x)
        x = x + residual
        if not self.convolution_first:
            x = self._apply_convolution(x, key_padding_mask)
        residual = x
        x = self.ffn2(x)
        x = x * 0.5 + residual
        return self.final_layer_norm(x)


class Conformer(torch.nn.Module):
    def __init__(self, input_dim, num_heads, ffn_dim, num_layers, depthwise_conv_kernel_size, dropout=0.0,
                 use_group_norm=False, convolution_first=False, conv_mask_padding=False):
        super().__init__()
        self.conformer_layers = torch.nn.ModuleList([
            ConformerLayer(input_dim, ffn_dim, num_heads, depthwise_conv_kernel_size, dropout=dropout,
                           use_group_norm=use_group_norm, convolution_first=convolution_first,
                           conv_mask_padding=conv_mask_padding)
            for _ in range(num_layers)])

    def forward(self, input, lengths):
        encoder_padding_mask = _lengths_to_padding_mask(lengths)
        x = input.transpose(0, 1)
        for layer in self.conformer_layers:
            x = layer(x, encoder_padding_mask)
        return x.transpose(0, 1), lengths


model = Conformer(input_dim=32, num_heads=4, ffn_dim=64, num_layers=2, depthwise_conv_kernel_size=7,
                  conv_mask_padding=FIXED).eval()
lengths = torch.tensor([24, 15, 9])
x = torch.randn(3, 24, 32)
with torch.no_grad():
    out, _ = model(x, lengths)
    diff = 0.0
    for b in range(3):
        L = int(lengths[b])
        alone, _ = model(x[b:b + 1, :L], lengths[b:b + 1])
        diff = max(diff, (out[b, :L] - alone[0]).abs().max().item())
print(f"max |batched - single-utterance| over valid frames: {diff:.6f}")

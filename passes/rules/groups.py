"""Op groups: the spellings of table lines too long to list on the line itself.

Each group names every spelling of its ops (``torch.X``, ``Tensor.X``, ``F.X``,
``torch.ops.aten.X``, the ``nn`` layer), so one line of ``registry`` covers an op however a
model or a capture spells it.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import partials
from .spellings import aten, modules_named, named, spellings
from .tokens import (
    ADD_NAMES,
    BROADCAST_NAMES,
    CAST_NAMES,
    COPY_NAMES,
    COUNT_NAMES,
    CUMSUM_NAMES,
    FLOOR_DIV_NAMES,
    LIKE_NAMES,
    MOD_NAMES,
    NEW_NAMES,
    PUT_NAMES,
    READ_NAMES,
    SIZE_NAMES,
    SORT_NAMES,
)

UNARY_MATH = spellings(
    "abs", "absolute", "acos", "arccos", "acosh", "asin", "arcsin", "asinh", "atan", "arctan",
    "atanh", "ceil", "cos", "cosh", "deg2rad", "digamma", "erf", "erfc", "erfinv", "exp",
    "exp2", "expm1", "fix", "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "logit",
    "i0", "nan_to_num", "rad2deg", "reciprocal", "round", "rsqrt", "sgn", "sigmoid", "sign",
    "signbit", "sin", "sinc", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "positive",
    "isnan", "isinf", "isfinite", "isposinf", "isneginf", "isreal", "logical_not",
    "bitwise_not", "clamp", "clamp_min", "clamp_max", "clip", "pow", "float_power",
    "conj", "conj_physical", "_conj", "_neg_view", "angle") + [
    "abs_", "ceil_", "clamp_", "clamp_min_", "clamp_max_", "exp_", "floor_", "log_", "pow_",
    "reciprocal_", "round_", "rsqrt_", "sigmoid_", "sqrt_", "tanh_", "trunc_", "nan_to_num_",
    "clip_"]
ACTIVATIONS = spellings(
    "relu", "relu_", "relu6", "gelu", "silu", "mish", "elu", "elu_", "selu", "celu",
    "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "softplus", "softsign",
    "tanhshrink", "hardswish", "hardsigmoid", "logsigmoid", "log_sigmoid", "threshold",
    "hardshrink", "softshrink", "rrelu", "prelu", "_prelu_kernel", "silu_", "hardswish_",
    "hardsigmoid_", "threshold_", "selu_", "celu_", "rrelu_") + modules_named(
    "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "ELU", "SELU", "CELU", "LeakyReLU", "Hardtanh",
    "Softplus", "Softsign", "Tanhshrink", "Hardswish", "Hardsigmoid", "LogSigmoid", "Threshold",
    "Hardshrink", "Softshrink", "RReLU", "PReLU", "Sigmoid", "Tanh", "Identity")
DROPOUTS = spellings(
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "feature_dropout", "native_dropout", "dropout_", "alpha_dropout_",
    "feature_dropout_") + modules_named(
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout")
BINARY = spellings(
    "maximum", "minimum", "fmax", "fmin", "fmod", "remainder", "atan2", "arctan2", "hypot",
    "copysign", "nextafter", "xlogy", "logaddexp", "logaddexp2", "floor_divide", "eq", "ne",
    "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal",
    "isclose", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "where", "masked_fill",
    "masked_fill_", "lerp", "lerp_", "addcmul", "addcmul_", "addcdiv", "addcdiv_", "heaviside",
    "polar", "complex", "ldexp", "__and__", "__or__", "__xor__", "__lshift__", "__rshift__")
OPERATORS = [
    operator.floordiv, operator.mod, operator.pow, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.invert,
    operator.xor, operator.lshift, operator.rshift, operator.abs, "__eq__", "__ne__", "__lt__",
    "__gt__", "__le__", "__ge__", "__pow__", "__rpow__", "__floordiv__", "__rfloordiv__",
    "__mod__", "__rmod__", "__invert__", "__abs__", "__iand__", "__ior__", "__ixor__", "eq_",
    "ne_", "lt_", "gt_", "le_", "ge_", "logical_not_", "logical_and_", "logical_or_"]
ADDS = [operator.add, operator.iadd, "add", "add_", "__add__", "__radd__", "__iadd__",
        *spellings("add", method=False)]
SUBS = [operator.sub, operator.isub, "sub", "sub_", "__sub__", "__rsub__", "__isub__",
        *spellings("sub", "subtract", "rsub", method=False), "subtract"]
MULS = [operator.mul, operator.imul, "mul", "mul_", "__mul__", "__rmul__", "__imul__",
        "multiply", *spellings("mul", "multiply", method=False)]
DIVS = [operator.truediv, operator.itruediv, "div", "div_", "__truediv__", "__rtruediv__",
        "__itruediv__", "true_divide", "divide",
        *spellings("div", "true_divide", "divide", method=False)]
NEGS = [operator.neg, operator.pos, "neg", "negative", "__neg__", "__pos__",
        *spellings("neg", "negative", method=False)]
CASTS = [
    "float", "double", "half", "bfloat16", "long", "int", "short", "char", "byte", "bool", "to",
    "type", "type_as", "cpu", "cuda", "contiguous", "clone", "requires_grad_", "pin_memory",
    "share_memory_", "float16", "float32",
    *spellings("clone", "_to_copy", "to", "contiguous", "lift_fresh_copy", "_to_dtype",
               "resolve_conj", "resolve_neg", "type_as", method=False)]
DETACHES = ["detach", "detach_", *spellings("detach", "alias", "lift_fresh", "lift",
                                            method=False)]
EXPORT_CHECKS = aten("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
                     "sym_constrain_range_for_size", "_assert_async")
RESHAPES = [
    "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel", nn.Flatten,
    nn.Unflatten, *spellings("reshape", "flatten", "unflatten", "view", "_unsafe_view",
                             "view_copy", "_reshape_alias", "ravel", "view_as", "reshape_as",
                             method=False)]
DIM_MOVES = [
    "permute", "transpose", "transpose_", "t", "swapaxes", "swapdims", "movedim", "moveaxis",
    "unsqueeze", "unsqueeze_", "expand", "expand_as", "broadcast_to", "narrow", "select",
    "slice", "adjoint", "mT", "mH", torch.broadcast_tensors,
    *aten("broadcast_tensors"),
    *spellings("permute", "transpose", "t", "swapaxes", "swapdims", "movedim", "moveaxis",
               "unsqueeze", "expand", "expand_as", "broadcast_to", "narrow", "select", "slice",
               "permute_copy", "transpose_copy", "unsqueeze_copy", "expand_copy", "slice_copy",
               "select_copy", "narrow_copy", "atleast_1d", "atleast_2d", "atleast_3d",
               "numpy_T", "adjoint", "matrix_H", "mT", "mH", method=False)]
SQUEEZES = ["squeeze", "squeeze_", *spellings("squeeze", "squeeze_copy", method=False)]
REPEATS = ["repeat", "tile", *spellings("repeat", "tile", method=False)]
REPEAT_INTERLEAVES = ["repeat_interleave", *spellings("repeat_interleave", method=False)]
FLIPS = ["flip", *spellings("flip", method=False)]
ROLLS = ["roll", *spellings("roll", method=False)]
TRIANGLES = ["tril", "triu", "tril_", "triu_", *spellings("tril", "triu", method=False)]
DIAGONALS = ["diagonal", "diag", "trace", "diagflat",
             *spellings("diagonal", "diag", "trace", "diagflat", method=False)]
UNFOLDS = ["unfold", *spellings("unfold", method=False, functional=False)]
SPLITS = [
    "chunk", "split", "unbind", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit",
    *spellings("chunk", "split", "unbind", "tensor_split", "split_with_sizes", "hsplit",
               "vsplit", "dsplit", "split_copy", "unbind_copy", method=False)]
JOINS = spellings("cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
                  "column_stack", "row_stack", method=False)
SIZES = ["size", "dim", "numel", "ndimension", "nelement", "stride", "element_size", "__len__",
         len, *spellings("sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "numel",
                         "size", "stride", method=False)]
NUMBERS = [torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not,
           torch.sym_sqrt, math.ceil, math.floor, math.sqrt, math.prod, int, float, abs]
VALUE_READS = ["item", "tolist", *aten("item", "_local_scalar_dense")]
INDEX_SELECTS = ["index_select", *spellings("index_select", method=False)]
GATHERS = [
    "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
    "scatter_reduce_", "take_along_dim", "index_add", "index_add_", "index_fill", "index_fill_",
    "index_copy", "index_copy_", "index_reduce",
    *spellings("gather", "scatter", "scatter_add", "scatter_reduce", "take_along_dim",
               "index_add", "index_fill", "index_reduce", "index_copy", method=False)]
SEARCHES = [torch.searchsorted, *aten("searchsorted")]
INDEX_PUTS = ["index_put", "index_put_",
              *spellings("index_put", "_index_put_impl", "_unsafe_index_put", method=False)]
CREATIONS = [
    "zero_", "zeros_like", "ones_like", "empty_like", "rand_like", "randn_like",
    "randint_like", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
    "cauchy_", "log_normal_", "geometric_",
    *spellings("zeros", "ones", "empty", "rand", "randn", "randint", "zeros_like", "ones_like",
               "empty_like", "rand_like", "randn_like", "randint_like", "empty_strided", "eye",
               "bernoulli", "normal", "randperm", "linspace", "logspace", "empty_permuted",
               "zero", "triu_indices", "tril_indices", "uniform", "exponential", "cauchy",
               "log_normal", "geometric", method=False),
    # elementwise draws from their arguments' rates (torch.distributions' Poisson, Gamma)
    *spellings("poisson", "binomial", "_standard_gamma", method=False),
    *aten("normal_functional")]
NEW_CREATIONS = spellings("new_zeros", "new_ones", "new_empty", "new_empty_strided",
                          torch_ns=False, functional=False)
FULLS = [*spellings("full", method=False), torch.full_like, *aten("full_like"), "fill_",
         *aten("fill")]
TENSORS = [torch.tensor, torch.as_tensor, torch.scalar_tensor, *aten("scalar_tensor", "tensor")]
MATMULS = [
    operator.matmul, "__matmul__", "__rmatmul__", "matmul", "mm", "bmm", "mv", "addmm",
    "baddbmm", "addbmm", "addmv", *spellings("matmul", "mm", "bmm", "mv", "addmm", "baddbmm",
                                             "addbmm", "addmv", "_addmm_activation",
                                             method=False)]
PRODUCTS = [
    "dot", "vdot", "inner", "outer", "ger", "tensordot",
    *spellings("dot", "vdot", "inner", "outer", "ger", "tensordot", "einsum", "chain_matmul",
               method=False)]
CROSSES = ["cross", *spellings("cross", "linalg_cross", method=False), torch.linalg.cross]
KRONS = ["kron", *spellings("kron", method=False)]
AS_STRIDED = ["as_strided", *spellings("as_strided", "as_strided_copy", method=False)]
LINEARS = [nn.Linear, nn.LazyLinear, *spellings("linear", method=False)]
BILINEARS = [nn.Bilinear, *spellings("bilinear", method=False)]
EMBEDDING_BAGS = [nn.EmbeddingBag, F.embedding_bag,
                  *aten("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")]
CONVS_AND_POOLS = modules_named(
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d",
    "LazyConvTranspose3d", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d",
    "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "LPPool1d", "LPPool2d",
    "LPPool3d", "FractionalMaxPool2d", "FractionalMaxPool3d", "MaxUnpool1d", "MaxUnpool2d",
    "MaxUnpool3d") + spellings(
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d", "lp_pool3d",
    "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices", "adaptive_max_pool1d_with_indices",
    "adaptive_max_pool2d_with_indices", "adaptive_max_pool3d_with_indices", "max_unpool1d",
    "max_unpool2d", "max_unpool3d", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
    "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    method=False)
CONVOLUTIONS = spellings("convolution", "_convolution", "conv_tbc", method=False)
RESAMPLES = [
    nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.ChannelShuffle, nn.Fold, nn.Unfold, F.interpolate, F.upsample,
    F.upsample_nearest, F.upsample_bilinear, F.fold, F.unfold, F.pixel_shuffle,
    F.pixel_unshuffle, F.channel_shuffle, torch.pixel_shuffle, torch.pixel_unshuffle,
    torch.channel_shuffle, *aten("pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
                                 "native_channel_shuffle", "im2col", "col2im")]
GRID_SAMPLES = [F.grid_sample, F.affine_grid,
                *aten("grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
                      "affine_grid_generator")]
PADS = [F.pad, torch.constant_pad_nd, *aten(
    "pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "_pad_circular",
    "_pad_enum")] + modules_named(
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d")
LAYER_NORMS = [nn.LayerNorm, nn.RMSNorm, F.layer_norm, F.rms_norm,
               *aten("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")]
GROUP_NORMS = [nn.GroupNorm, F.group_norm, *aten("group_norm", "native_group_norm")]
BATCH_NORMS = modules_named(
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
    "LazyBatchNorm2d", "LazyBatchNorm3d") + [F.batch_norm] + aten(
    "batch_norm", "native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm",
    "_batch_norm_with_update", "_batch_norm_no_update", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training")
INSTANCE_NORMS = modules_named(
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LazyInstanceNorm1d",
    "LazyInstanceNorm2d", "LazyInstanceNorm3d") + [F.instance_norm, *aten("instance_norm")]
LOCAL_NORMS = [nn.LocalResponseNorm, nn.CrossMapLRN2d, F.local_response_norm]
SOFTMAXES = spellings("softmax", "log_softmax", "softmin", "_softmax", "_log_softmax",
                      "_safe_softmax")
SCANS = spellings("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "cumsum_",
                  "_logcumsumexp")
SORTS = spellings("sort", "argsort", "msort")
RANKS = spellings("topk", "kthvalue")
VECTOR_PAIRS = [F.cosine_similarity, F.pairwise_distance, nn.CosineSimilarity,
                nn.PairwiseDistance, torch.cdist,
                *aten("cosine_similarity", "pairwise_distance", "cdist", "_cdist_forward")]
PDISTS = [F.pdist, torch.pdist, *aten("pdist", "_pdist_forward")]
ATTENTIONS = spellings("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                       "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_flash_attention", method=False)
TRANSFORMERS = modules_named("TransformerEncoderLayer", "TransformerDecoderLayer",
                             "TransformerEncoder", "TransformerDecoder", "Transformer")
RNNS = [nn.RNN, nn.LSTM, nn.GRU, *aten("lstm", "gru", "rnn_tanh", "rnn_relu")]
RNN_CELLS = [nn.RNNCell, nn.LSTMCell, nn.GRUCell,
             *aten("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")]
NONLINEAR_REDUCTIONS = spellings(
    "amax", "amin", "max", "min", "aminmax", "logsumexp", "prod", "std", "var", "std_mean",
    "var_mean", "argmax", "argmin", "median", "nanmedian", "mode", "all", "any",
    "count_nonzero", "nanmean", "quantile", "nanquantile")
VECTOR_NORMS = [*spellings("norm", "linalg_vector_norm", "frobenius_norm", "nuclear_norm"),
                torch.linalg.vector_norm, torch.linalg.norm, "norm"]
MATRIX_NORMS = [torch.linalg.matrix_norm, *aten("linalg_matrix_norm")]
DATA_SHAPED = spellings("histc", "bincount", "unique", "unique_consecutive", "nonzero",
                        "argwhere", "masked_select")
LOSS_SPELLINGS = [op for loss in partials.LOSSES for op in loss.spellings]

# Token dispatch (tokens.py): the ops with a meaning of their own on sorted rows
TOKEN_SORTS = named(SORT_NAMES)
TOKEN_COUNTS = named(COUNT_NAMES)
TOKEN_CUMSUMS = named(CUMSUM_NAMES)
TOKEN_CASTS = named(CAST_NAMES)
TOKEN_LIKES = named(LIKE_NAMES)
TOKEN_BROADCASTS = named(BROADCAST_NAMES)
TOKEN_FLOOR_DIVS = named(FLOOR_DIV_NAMES)
TOKEN_MODS = named(MOD_NAMES)
TOKEN_DIVS = named({"div"})
TOKEN_READS = named(READ_NAMES)
TOKEN_WRITES = named(ADD_NAMES | PUT_NAMES | COPY_NAMES)
TOKEN_SIZES = named(SIZE_NAMES)
TOKEN_NEWS = named(NEW_NAMES)
# Grouped matmuls (grouped_matmuls.py), by qualified name: their libraries load them late
GROUPED_MMS = ["aten::_grouped_mm", "torch._grouped_mm"]
F_GROUPED_MMS = ["torch.nn.functional.grouped_mm"]
HF_GROUPED_MMS = ["transformers::grouped_mm_fallback"]

// 2:4 sparse-tensor-core forward convolution (gather-fused implicit GEMM) and a one-warp mma.sp probe,
// exported as XLA FFI handlers.
//
// The convolution computes out[i, co] = sum_v sum_ci x[nbr[i, v], ci] * W[co, v, ci] for i < num (rows i >= num,
// and sites whose neighbour is -1 at an offset, contribute zeros). It runs the GEMM in the swapped-operand form
// out^T = A B with
//   A = W as [Cout, V * Cin], 2:4 sparse along its reduction axis and given compressed (jsparse.sparsity's
//       Compressed2to4 with axis="cin": values [Cout, V, Cin / 2], uint16 metadata [Cout, V, Cin / 16]);
//   B = the gathered features transposed, [V * Cin, sites]: column n of B's K chunk (v, c0 .. c0 + 31) is
//       x[nbr[n, v], c0 .. c0 + 31], contiguous in memory, which is exactly mma's ".col" B operand.
// One K step is 32 dense channels of one kernel offset (Cin % 32 == 0), so a 2:4 group never straddles offsets
// and every K step reads one neighbour row per site.
//
// CTA tiles (TileSmall / TileWide / TileLarge below, picked by shape or by the `tile` attribute): 2 x 2 or 4 x 2
// warps, each warp 32 output channels x 32 or 64 sites = 2 (m16) x 4 or 8 (n8) mma.sp.m16n8k32 per K step,
// float32 accumulators. A values, A metadata and the gathered B tile of each K step are copied to shared memory
// with cp.async into a 3- or 4-deep ring (the copies of later steps overlap the MMAs of the current one); A and
// B fragments come out of shared memory with ldmatrix. Offsets that no site of the tile uses are skipped whole
// (surface-like inputs leave many of them empty). The epilogue stages the tile through shared memory so that the
// output is written in 16-byte rows.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sparse24 {

constexpr int kStepK = 32;          // dense reduction elements per K step (one mma.sp m16n8k32)
constexpr int kMaxOffsets = 1024;   // V limit (the active-offset list lives in shared memory)
// Shared-memory row strides in 16-bit elements, padded so that the 8 rows an ldmatrix phase reads fall in
// distinct banks (48 B and 80 B strides step through all 8 four-bank groups).
constexpr int kAStride = kStepK / 2 + 8;   // 16 compressed values + 8 pad = 48 B
constexpr int kBStride = kStepK + 8;       // 32 channels + 8 pad = 80 B

// Metadata register layouts for mma.sp m16n8k32 with f16/bf16 (the sparsity selector is 0: lanes with
// threadID_in_group 0 and 1 supply it). Layout 0 (kMetaHalves): lane 4g + h holds K half h (16 dense columns,
// one uint16 word) of row g in bits 0-15 and of row g + 8 in bits 16-31. Layout 1 (kMetaRows): lane 4g holds
// both words of row g (word 0 low), lane 4g + 1 both words of row g + 8. Layouts 2 and 3: 0 and 1 with the roles
// of lanes 4g and 4g + 1 swapped. The one-warp probe checks each against numpy; the convolution takes the
// layout as an attribute (jsparse.sparse24.META_LAYOUT) so that a test can run any of them. Bit 0 of the
// layout number says rows (1) or halves (0), bit 1 swaps the lanes.
constexpr int64_t kMetaRows = 1;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; src_bytes = 0 writes zeros (a missing neighbour, a row past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 16-bit matrices: lane l supplies the row address of matrix l / 8; register j receives matrix j's
// elements (row lane / 4, columns 2 * (lane % 4) and + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

template <typename T>
struct MmaType;
template <>
struct MmaType<__half> {
  static constexpr bool kBf16 = false;
};
template <>
struct MmaType<__nv_bfloat16> {
  static constexpr bool kBf16 = true;
};

// d += A (16 x 32, 2:4 sparse, compressed to 16 x 16 in a[4] with metadata e) * B (32 x 8 in b[4]).
template <typename T>
__device__ __forceinline__ void mma_sp_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                                             uint32_t e) {
  if constexpr (MmaType<T>::kBf16) {
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
  } else {
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
  }
}

// The metadata register of this lane for the 16 rows whose two words (word 0 low) are row_words[0 .. 15].
__device__ __forceinline__ uint32_t meta_register(const uint32_t* row_words, int lane, int64_t layout) {
  const int g = lane >> 2;
  const uint32_t top = row_words[g], bottom = row_words[g + 8];
  const int which = (lane & 1) ^ int((layout >> 1) & 1);  // lanes 2 and 3 are not read: they copy lanes 0 and 1
  if ((layout & 1) == kMetaRows) {
    return which ? bottom : top;
  }
  return ((top >> (16 * which)) & 0xFFFFu) | (((bottom >> (16 * which)) & 0xFFFFu) << 16);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// ---- the convolution --------------------------------------------------------------------------------------

struct ConvArgs {
  const void* x;           // [rows, Cin] features
  const uint16_t* values;  // [Cout, V, Cin / 2] compressed weight (16-bit elements of x's dtype)
  const uint16_t* meta;    // [Cout, V, Cin / 16]
  const int32_t* nbr;      // [M, V]
  const int32_t* num;      // scalar on the device: valid output rows
  void* out;               // [M, Cout]
  int64_t rows_x;          // rows of x (a neighbour index past it reads zeros)
  int64_t m;               // output rows
  int cin, cout, v;
  int64_t meta_layout;
};

// A CTA tile: kWarpsM x kWarpsN warps, each 32 output channels x kWarpSites sites, kStages-deep copy ring.
template <int kWarpsM_, int kWarpsN_, int kWarpSites_, int kStages_>
struct Tile {
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_, kWarpSites = kWarpSites_, kStages = kStages_;
  static constexpr int kCout = 32 * kWarpsM;            // output channels per CTA (rows of A)
  static constexpr int kSites = kWarpSites * kWarpsN;   // sites per CTA (columns of B)
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kN8 = kWarpSites / 8;            // n8 MMA tiles per warp
  struct Stage {
    uint16_t a[kCout * kAStride];    // compressed A values of one K step, one row per output channel
    uint32_t meta[kCout];            // the two metadata words of each row for this K step (word 0 low)
    uint16_t b[kSites * kBStride];   // gathered features of one K step, one row per site
  };
  static constexpr int kOutStride = kCout + 8;  // epilogue tile row (one site), padded against bank conflicts
  static_assert(sizeof(Stage) % 16 == 0, "stages must stay 16-byte aligned");
  // The epilogue's [site][channel] tile reuses the stages' memory.
  union Shared {
    Stage stages[kStages];
    uint16_t out[kSites * kOutStride];
  };
  static_assert(sizeof(Shared) + 4 * kMaxOffsets + 16 <= 160 * 1024, "fits an SM80 / SM90 CTA with room to spare");
};

// Issues the cp.async copies of K step (offset v, channels c0 .. c0 + 31) into `stage`.
template <typename Tl>
__device__ __forceinline__ void load_step(typename Tl::Stage& stage, const ConvArgs& p, int cout0, int64_t site0,
                                          int v, int c0, int num) {
  const int tid = threadIdx.x;
  // A values: kCout rows x 32 bytes, two 16-byte chunks per row.
  for (int idx = tid; idx < 2 * Tl::kCout; idx += Tl::kThreads) {
    const int row = idx >> 1, chunk = idx & 1;
    const int co = cout0 + row;
    const bool ok = co < p.cout;
    const uint16_t* src = p.values + ((int64_t)(ok ? co : 0) * p.v + v) * (p.cin / 2) + c0 / 2 + chunk * 8;
    cp_async16(&stage.a[row * kAStride + chunk * 8], src, ok ? 16 : 0);
  }
  // Metadata: 4 bytes per row. Rows past Cout get the (0, 1) pattern over their zero values (a valid index).
  for (int row = tid; row < Tl::kCout; row += Tl::kThreads) {
    const int co = cout0 + row;
    if (co < p.cout) {
      cp_async4(&stage.meta[row], p.meta + ((int64_t)co * p.v + v) * (p.cin / 16) + c0 / 16);
    } else {
      stage.meta[row] = 0x44444444u;
    }
  }
  // B: kSites rows x 64 bytes, four chunks per row: the site's neighbour row at offset v, or zeros.
  for (int idx = tid; idx < 4 * Tl::kSites; idx += Tl::kThreads) {
    const int site = idx >> 2, chunk = idx & 3;
    const int64_t i = site0 + site;
    int64_t r = -1;
    if (i < p.m && i < num) r = p.nbr[i * p.v + v];
    const bool ok = r >= 0 && r < p.rows_x;
    const uint16_t* src = static_cast<const uint16_t*>(p.x) + (ok ? r : 0) * p.cin + c0 + chunk * 8;
    cp_async16(&stage.b[site * kBStride + chunk * 8], src, ok ? 16 : 0);
  }
}

template <typename T, typename Tl>
__global__ void __launch_bounds__(Tl::kThreads) sparse24_conv_kernel(ConvArgs p) {
  using Stage = typename Tl::Stage;
  extern __shared__ __align__(16) unsigned char dynamic_shared[];  // sizeof(Tl::Shared) bytes (launch_conv)
  typename Tl::Shared& shared = *reinterpret_cast<typename Tl::Shared*>(dynamic_shared);
  Stage* stages = shared.stages;
  __shared__ int active[kMaxOffsets];
  __shared__ int num_active;

  const int cout_tiles = (p.cout + Tl::kCout - 1) / Tl::kCout;
  const int cout0 = (blockIdx.x % cout_tiles) * Tl::kCout;  // neighbouring CTAs share sites: their gathers hit L2
  const int64_t site0 = (int64_t)(blockIdx.x / cout_tiles) * Tl::kSites;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp % Tl::kWarpsM, warp_n = warp / Tl::kWarpsM;  // warp tile: channels 32 * warp_m, ...
  const int num = *p.num;

  // The offsets some site of this tile has a neighbour at (the others contribute nothing).
  if (tid == 0) num_active = 0;
  __syncthreads();
  for (int v = 0; v < p.v; ++v) {
    bool used = false;
    for (int site = tid; site < Tl::kSites; site += Tl::kThreads) {
      const int64_t i = site0 + site;
      used |= i < p.m && i < num && p.nbr[i * p.v + v] >= 0;
    }
    if (__syncthreads_or(used) && tid == 0) active[num_active++] = v;
  }
  __syncthreads();
  const int chunks_per_offset = p.cin / kStepK;
  const int steps = num_active * chunks_per_offset;

  float acc[2][Tl::kN8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tl::kN8; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

  // Prologue: fill kStages - 1 stages (empty commit groups keep the group count uniform).
#pragma unroll
  for (int s = 0; s < Tl::kStages - 1; ++s) {
    if (s < steps) {
      load_step<Tl>(stages[s], p, cout0, site0, active[s / chunks_per_offset], (s % chunks_per_offset) * kStepK,
                    num);
    }
    cp_async_commit();
  }

  for (int step = 0; step < steps; ++step) {
    cp_async_wait<Tl::kStages - 2>();
    __syncthreads();  // step's stage is complete for every thread; the stage refilled below is free
    const int next = step + Tl::kStages - 1;
    if (next < steps) {
      load_step<Tl>(stages[next % Tl::kStages], p, cout0, site0, active[next / chunks_per_offset],
                    (next % chunks_per_offset) * kStepK, num);
    }
    cp_async_commit();

    const Stage& st = stages[step % Tl::kStages];
    // A fragments (compressed 16 x 16 per m16 tile): matrices (rows 0-7, cols 0-7), (rows 8-15, cols 0-7),
    // (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) give registers a0 .. a3.
    uint32_t a[2][4], e[2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int row0 = warp_m * 32 + mt * 16;
      const int mat = lane >> 3, r = lane & 7;
      const int row = row0 + r + (mat & 1) * 8, col = (mat >> 1) * 8;
      ldmatrix_x4(a[mt], &st.a[row * kAStride + col]);
      e[mt] = meta_register(&st.meta[row0], lane, p.meta_layout);
    }
    // B fragments (32 x 8 per n8 tile, stored as 8 site rows of 32 channels): matrix j holds channels 8j .. 8j + 7,
    // which are registers b0 .. b3 of mma's .col B.
#pragma unroll
    for (int nt = 0; nt < Tl::kN8; ++nt) {
      uint32_t b[4];
      const int site = warp_n * Tl::kWarpSites + nt * 8 + (lane & 7);
      ldmatrix_x4(b, &st.b[site * kBStride + (lane >> 3) * 8]);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) mma_sp_16832<T>(acc[mt][nt], a[mt], b, e[mt]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every stage is idle: the epilogue reuses their memory

  // Epilogue: accumulator (row = channel g / g + 8, column = site 2t / 2t + 1) -> a [site][channel] tile.
  uint16_t* tile = shared.out;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tl::kN8; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int ch = warp_m * 32 + mt * 16 + g + half * 8;
        const int site = warp_n * Tl::kWarpSites + nt * 8 + 2 * t;
        const uint32_t two = pack2<T>(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
        tile[site * Tl::kOutStride + ch] = static_cast<uint16_t>(two & 0xFFFFu);
        tile[(site + 1) * Tl::kOutStride + ch] = static_cast<uint16_t>(two >> 16);
      }
  __syncthreads();
  // Rows of 8 channels (16 bytes); Cout % 16 == 0 keeps every row either whole inside the output or outside.
  uint16_t* out = static_cast<uint16_t*>(p.out);
  constexpr int kChunksPerSite = Tl::kCout / 8;
  for (int idx = tid; idx < Tl::kSites * kChunksPerSite; idx += Tl::kThreads) {
    const int site = idx / kChunksPerSite, chunk = idx % kChunksPerSite;
    const int64_t i = site0 + site;
    const int ch = cout0 + chunk * 8;
    if (i < p.m && ch < p.cout) {
      *reinterpret_cast<uint4*>(out + i * p.cout + ch) =
          *reinterpret_cast<const uint4*>(&tile[site * Tl::kOutStride + chunk * 8]);
    }
  }
}

// The tiles the handler can launch (attribute `tile`; 0 picks one by shape).
using TileSmall = Tile<2, 2, 32, 3>;   // 64 channels x 64 sites, 4 warps, 3 stages (33 KB)
using TileWide = Tile<2, 2, 64, 4>;    // 64 channels x 128 sites, 4 warps, 4 stages (54 KB)
using TileLarge = Tile<4, 2, 64, 3>;   // 128 channels x 128 sites, 8 warps, 3 stages (51 KB)

template <typename T, typename Tl>
cudaError_t launch_conv(const ConvArgs& p, cudaStream_t stream) {
  const int64_t blocks = ((p.cout + Tl::kCout - 1) / Tl::kCout) * ((p.m + Tl::kSites - 1) / Tl::kSites);
  constexpr int kBytes = sizeof(typename Tl::Shared);
  // Above 48 KB of dynamic shared memory a kernel must opt in (per device; cheap to repeat).
  cudaError_t err = cudaFuncSetAttribute(sparse24_conv_kernel<T, Tl>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kBytes);
  if (err != cudaSuccess) return err;
  sparse24_conv_kernel<T, Tl><<<(unsigned)blocks, Tl::kThreads, kBytes, stream>>>(p);
  return cudaGetLastError();
}

// 1, 2, 3: TileSmall, TileWide, TileLarge; 0: Large when Cout >= 128 and there are enough sites to fill the GPU
// with 128-site tiles, Wide on many sites, Small otherwise.
inline int pick_tile(int64_t tile, int64_t m, int64_t cout) {
  if (tile != 0) return (int)tile;
  if (m >= 32768 && cout >= 128) return 3;
  if (m >= 32768) return 2;
  return 1;
}

template <typename T>
cudaError_t launch_conv_tile(const ConvArgs& p, int tile, cudaStream_t stream) {
  if (tile == 1) return launch_conv<T, TileSmall>(p, stream);
  if (tile == 2) return launch_conv<T, TileWide>(p, stream);
  return launch_conv<T, TileLarge>(p, stream);
}

// ---- one-warp probe: one mma.sp m16n8k32 on given operands -------------------------------------------------

// a_values: [16, 16] compressed A (row-major), a_meta: [16, 2] uint16 words (row-major: word 0 = dense columns
// 0-15), b: [8, 32] (B transposed: row n holds column n of B), d: [16, 8] float32 = A_dense @ B.
template <typename T>
__global__ void mma_sp_probe_kernel(const uint16_t* a_values, const uint16_t* a_meta, const uint16_t* b_t, float* d,
                                    int64_t meta_layout) {
  __shared__ __align__(16) uint16_t sa[16 * kAStride];
  __shared__ __align__(16) uint16_t sb[8 * kBStride];
  __shared__ uint32_t smeta[16];
  const int lane = threadIdx.x;
  for (int k = lane; k < 16 * 16; k += 32) sa[(k / 16) * kAStride + k % 16] = a_values[k];
  for (int k = lane; k < 8 * 32; k += 32) sb[(k / 32) * kBStride + k % 32] = b_t[k];
  if (lane < 16) smeta[lane] = a_meta[2 * lane] | (uint32_t(a_meta[2 * lane + 1]) << 16);
  __syncwarp();
  uint32_t a[4], b[4];
  const int mat = lane >> 3, r = lane & 7;
  ldmatrix_x4(a, &sa[(r + (mat & 1) * 8) * kAStride + (mat >> 1) * 8]);
  ldmatrix_x4(b, &sb[r * kBStride + mat * 8]);
  const uint32_t e = meta_register(smeta, lane, meta_layout);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  mma_sp_16832<T>(acc, a, b, e);
  const int g = lane >> 2, t = lane & 3;
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

}  // namespace sparse24

// ---- XLA FFI handlers ------------------------------------------------------------------------------------------

static ffi::Error check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

static ffi::Error Sparse24ConvImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                   ffi::Buffer<ffi::U16> meta, ffi::Buffer<ffi::S32> nbr, ffi::Buffer<ffi::S32> num,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t meta_layout, int64_t tile) {
  using namespace sparse24;
  const auto xd = x.dimensions(), vd = values.dimensions(), md = meta.dimensions(), nd = nbr.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || vd.size() != 3 || md.size() != 3 || nd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("sparse24_conv: x [rows, Cin], values [Cout, V, Cin/2], metadata "
                                       "[Cout, V, Cin/16], nbr [M, V], out [M, Cout] expected");
  }
  const int64_t cin = xd[1], cout = vd[0], v = vd[1], m = nd[0];
  if (cin % kStepK || cout % 16 || vd[2] != cin / 2 || md[0] != cout || md[1] != v || md[2] != cin / 16 ||
      nd[1] != v || od[0] != m || od[1] != cout || v > kMaxOffsets || v < 1) {
    return ffi::Error::InvalidArgument("sparse24_conv: shapes disagree (needs Cin % 32 == 0, Cout % 16 == 0, "
                                       "1 <= V <= 1024)");
  }
  if (x.element_type() != values.element_type() || x.element_type() != out->element_type()) {
    return ffi::Error::InvalidArgument("sparse24_conv: x, values and out must share one dtype");
  }
  if (meta_layout < 0 || meta_layout > 3) {
    return ffi::Error::InvalidArgument("sparse24_conv: meta_layout must be 0 .. 3");
  }
  if (tile < 0 || tile > 3) return ffi::Error::InvalidArgument("sparse24_conv: tile must be 0 .. 3");
  if (m == 0 || cout == 0) return ffi::Error::Success();
  if ((m + 63) / 64 * ((cout + 63) / 64) > 0x7FFFFFFF) {
    return ffi::Error::InvalidArgument("sparse24_conv: too many output rows");
  }
  ConvArgs p{x.untyped_data(), static_cast<const uint16_t*>(values.untyped_data()), meta.typed_data(),
             nbr.typed_data(), num.typed_data(), out->untyped_data(), xd[0], m, (int)cin, (int)cout, (int)v,
             meta_layout};
  const int picked = pick_tile(tile, m, cout);
  cudaError_t err;
  if (x.element_type() == ffi::DataType::F16) {
    err = launch_conv_tile<__half>(p, picked, stream);
  } else if (x.element_type() == ffi::DataType::BF16) {
    err = launch_conv_tile<__nv_bfloat16>(p, picked, stream);
  } else {
    return ffi::Error::InvalidArgument("sparse24_conv: x must be float16 or bfloat16");
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse24_conv launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Sparse24Conv, Sparse24ConvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // values
                                  .Arg<ffi::Buffer<ffi::U16>>()  // metadata
                                  .Arg<ffi::Buffer<ffi::S32>>()  // nbr
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int64_t>("meta_layout")
                                  .Attr<int64_t>("tile"));

static ffi::Error MmaSpProbeImpl(cudaStream_t stream, ffi::AnyBuffer a_values, ffi::Buffer<ffi::U16> a_meta,
                                 ffi::AnyBuffer b_t, ffi::Result<ffi::Buffer<ffi::F32>> d, int64_t meta_layout) {
  using namespace sparse24;
  if (a_values.element_count() != 256 || a_meta.element_count() != 32 || b_t.element_count() != 256 ||
      d->element_count() != 128 || a_values.element_type() != b_t.element_type()) {
    return ffi::Error::InvalidArgument("mma_sp_probe: a_values [16, 16], a_meta [16, 2], b_t [8, 32] of one "
                                       "16-bit dtype, d [16, 8] float32 expected");
  }
  auto* av = static_cast<const uint16_t*>(a_values.untyped_data());
  auto* bv = static_cast<const uint16_t*>(b_t.untyped_data());
  if (a_values.element_type() == ffi::DataType::F16) {
    mma_sp_probe_kernel<__half><<<1, 32, 0, stream>>>(av, a_meta.typed_data(), bv, d->typed_data(), meta_layout);
  } else if (a_values.element_type() == ffi::DataType::BF16) {
    mma_sp_probe_kernel<__nv_bfloat16><<<1, 32, 0, stream>>>(av, a_meta.typed_data(), bv, d->typed_data(),
                                                             meta_layout);
  } else {
    return ffi::Error::InvalidArgument("mma_sp_probe: float16 or bfloat16 operands expected");
  }
  return check_launch("mma_sp_probe");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MmaSpProbe, MmaSpProbeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a_values
                                  .Arg<ffi::Buffer<ffi::U16>>()  // a_meta
                                  .Arg<ffi::AnyBuffer>()         // b_t
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d
                                  .Attr<int64_t>("meta_layout"));

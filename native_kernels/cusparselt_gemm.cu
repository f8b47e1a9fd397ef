// Gather-free 2:4 GEMMs on cuSPARSELt, exported as XLA FFI handlers (host code only: the kernels are the
// library's). Used where a convolution has no gather to fuse (1x1x1 submanifold convolutions, linear heads).
//
// Shapes follow PyTorch's semi-structured convention, so the compressed bytes are the ones torch._cslt_compress
// makes for the same weight:
//   W: the dense 2:4 weight [M, K] row-major (M outputs, K the reduction axis along which every group of four
//      holds at most two non-zeros); its compressed form is an opaque uint8 buffer of the size cuSPARSELt reports.
//   x: features [N, K] row-major; out: [N, M] row-major.
// The product is computed as out^T = W x^T: A = W (structured, row-major), B = x^T ([K, N] column-major, which is
// x's memory as it is), D = out^T ([M, N] column-major, which is out's memory), float32 accumulation.
//
// Exported besides the FFI handlers (C symbols for ctypes): the byte sizes the Python side must allocate.
#include <cuda_runtime.h>
#include <cusparseLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr unsigned kAlignment = 16;  // bytes; every buffer XLA hands over is at least this aligned

std::string status_text(cusparseStatus_t status) {
  return std::to_string(static_cast<int>(status));
}

// One library handle per device, made on first use and kept for the process.
struct Handles {
  std::mutex lock;
  std::map<int, std::unique_ptr<cusparseLtHandle_t>> by_device;
};

Handles& handles() {
  static Handles* all = new Handles();  // never destroyed: plans may be in use at exit
  return *all;
}

cusparseStatus_t handle_for_current_device(cusparseLtHandle_t** out) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return CUSPARSE_STATUS_EXECUTION_FAILED;
  Handles& all = handles();
  std::lock_guard<std::mutex> guard(all.lock);
  auto found = all.by_device.find(device);
  if (found == all.by_device.end()) {
    auto handle = std::make_unique<cusparseLtHandle_t>();
    cusparseStatus_t status = cusparseLtInit(handle.get());
    if (status != CUSPARSE_STATUS_SUCCESS) return status;
    found = all.by_device.emplace(device, std::move(handle)).first;
  }
  *out = found->second.get();
  return CUSPARSE_STATUS_SUCCESS;
}

cudaDataType value_type(int dtype) { return dtype == 1 ? CUDA_R_16BF : CUDA_R_16F; }

// The structured descriptor of W [m, k] row-major: the one compression and the matmul both use.
cusparseStatus_t weight_descriptor(cusparseLtHandle_t* handle, cusparseLtMatDescriptor_t* desc, int64_t m,
                                   int64_t k, int dtype) {
  return cusparseLtStructuredDescriptorInit(handle, desc, m, k, k, kAlignment, value_type(dtype), CUSPARSE_ORDER_ROW,
                                            CUSPARSELT_SPARSITY_50_PERCENT);
}

// A matmul plan for (m, n, k, dtype), kept for the process: plans are costly to make and a network reuses few.
struct Plan {
  cusparseLtMatDescriptor_t a, b, c;
  cusparseLtMatmulDescriptor_t matmul;
  cusparseLtMatmulAlgSelection_t selection;
  cusparseLtMatmulPlan_t plan;
  size_t workspace = 0;
};

struct Plans {
  std::mutex lock;
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int>, std::unique_ptr<Plan>> by_key;
};

Plans& plans() {
  static Plans* all = new Plans();
  return *all;
}

#define RETURN_IF_FAILED(call)                           \
  do {                                                   \
    cusparseStatus_t status_ = (call);                   \
    if (status_ != CUSPARSE_STATUS_SUCCESS) return status_; \
  } while (0)

cusparseStatus_t make_plan(cusparseLtHandle_t* handle, int64_t m, int64_t n, int64_t k, int dtype, Plan* p) {
  RETURN_IF_FAILED(weight_descriptor(handle, &p->a, m, k, dtype));
  RETURN_IF_FAILED(cusparseLtDenseDescriptorInit(handle, &p->b, k, n, k, kAlignment, value_type(dtype),
                                                 CUSPARSE_ORDER_COL));
  RETURN_IF_FAILED(cusparseLtDenseDescriptorInit(handle, &p->c, m, n, m, kAlignment, value_type(dtype),
                                                 CUSPARSE_ORDER_COL));
  RETURN_IF_FAILED(cusparseLtMatmulDescriptorInit(handle, &p->matmul, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                                  CUSPARSE_OPERATION_NON_TRANSPOSE, &p->a, &p->b, &p->c, &p->c,
                                                  CUSPARSE_COMPUTE_32F));
  RETURN_IF_FAILED(cusparseLtMatmulAlgSelectionInit(handle, &p->selection, &p->matmul,
                                                    CUSPARSELT_MATMUL_ALG_DEFAULT));
  RETURN_IF_FAILED(cusparseLtMatmulPlanInit(handle, &p->plan, &p->matmul, &p->selection));
  return cusparseLtMatmulGetWorkspace(handle, &p->plan, &p->workspace);
}

cusparseStatus_t plan_for(int64_t m, int64_t n, int64_t k, int dtype, cusparseLtHandle_t** handle, Plan** out) {
  RETURN_IF_FAILED(handle_for_current_device(handle));
  int device = 0;
  cudaGetDevice(&device);
  Plans& all = plans();
  std::lock_guard<std::mutex> guard(all.lock);
  auto key = std::make_tuple(device, m, n, k, dtype);
  auto found = all.by_key.find(key);
  if (found == all.by_key.end()) {
    auto plan = std::make_unique<Plan>();
    RETURN_IF_FAILED(make_plan(*handle, m, n, k, dtype, plan.get()));
    found = all.by_key.emplace(key, std::move(plan)).first;
  }
  *out = found->second.get();
  return CUSPARSE_STATUS_SUCCESS;
}

int dtype_code(ffi::DataType type) {
  if (type == ffi::DataType::F16) return 0;
  if (type == ffi::DataType::BF16) return 1;
  return -1;
}

ffi::Error failed(const char* what, cusparseStatus_t status) {
  return ffi::Error::Internal(std::string(what) + " failed with cusparseStatus_t " + status_text(status));
}

}  // namespace

// ---- sizes, for the Python side (ctypes) ----------------------------------------------------------------------

// sizes[0]: the compressed weight's bytes, sizes[1]: the scratch compression needs. 0 on success, else the
// cusparseStatus_t.
extern "C" int JsparseCsltCompressedSize(int64_t m, int64_t k, int dtype, uint64_t* sizes) {
  cusparseLtHandle_t* handle = nullptr;
  cusparseStatus_t status = handle_for_current_device(&handle);
  if (status != CUSPARSE_STATUS_SUCCESS) return static_cast<int>(status);
  cusparseLtMatDescriptor_t desc;
  status = weight_descriptor(handle, &desc, m, k, dtype);
  if (status != CUSPARSE_STATUS_SUCCESS) return static_cast<int>(status);
  size_t compressed = 0, scratch = 0;
  status = cusparseLtSpMMACompressedSize2(handle, &desc, &compressed, &scratch);
  cusparseLtMatDescriptorDestroy(&desc);
  sizes[0] = compressed;
  sizes[1] = scratch;
  return static_cast<int>(status);
}

// The matmul's workspace bytes for out [n, m] = x [n, k] W^T; 0 on success, else the cusparseStatus_t.
extern "C" int JsparseCsltWorkspaceSize(int64_t m, int64_t n, int64_t k, int dtype, uint64_t* size) {
  cusparseLtHandle_t* handle = nullptr;
  Plan* plan = nullptr;
  cusparseStatus_t status = plan_for(m, n, k, dtype, &handle, &plan);
  if (status != CUSPARSE_STATUS_SUCCESS) return static_cast<int>(status);
  *size = plan->workspace;
  return 0;
}

// ---- FFI handlers ---------------------------------------------------------------------------------------------

// weight [M, K] (dense, 2:4 along K) -> compressed (uint8, JsparseCsltCompressedSize bytes); scratch: its
// scratch buffer (at least one byte, so XLA can allocate it).
static ffi::Error CompressImpl(cudaStream_t stream, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> compressed,
                               ffi::Result<ffi::AnyBuffer> scratch) {
  auto dims = weight.dimensions();
  int dtype = dtype_code(weight.element_type());
  if (dims.size() != 2 || dtype < 0) {
    return ffi::Error::InvalidArgument("cslt_compress: weight must be a float16 or bfloat16 [M, K] matrix");
  }
  cusparseLtHandle_t* handle = nullptr;
  cusparseStatus_t status = handle_for_current_device(&handle);
  if (status != CUSPARSE_STATUS_SUCCESS) return failed("cslt_compress: cusparseLtInit", status);
  cusparseLtMatDescriptor_t desc;
  status = weight_descriptor(handle, &desc, dims[0], dims[1], dtype);
  if (status != CUSPARSE_STATUS_SUCCESS) return failed("cslt_compress: the weight descriptor", status);
  size_t need = 0, need_scratch = 0;
  status = cusparseLtSpMMACompressedSize2(handle, &desc, &need, &need_scratch);
  if (status == CUSPARSE_STATUS_SUCCESS && (compressed->size_bytes() < need || scratch->size_bytes() < need_scratch)) {
    cusparseLtMatDescriptorDestroy(&desc);
    return ffi::Error::InvalidArgument("cslt_compress: output buffers smaller than cuSPARSELt needs");
  }
  if (status == CUSPARSE_STATUS_SUCCESS) {
    status = cusparseLtSpMMACompress2(handle, &desc, 1, CUSPARSE_OPERATION_NON_TRANSPOSE, weight.untyped_data(),
                                      compressed->untyped_data(), need_scratch ? scratch->untyped_data() : nullptr,
                                      stream);
  }
  cusparseLtMatDescriptorDestroy(&desc);
  if (status != CUSPARSE_STATUS_SUCCESS) return failed("cslt_compress: cusparseLtSpMMACompress2", status);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CsltCompress, CompressImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // weight
                                  .Ret<ffi::AnyBuffer>()   // compressed
                                  .Ret<ffi::AnyBuffer>()); // scratch

// out [N, M] = x [N, K] W^T with W given compressed; workspace: JsparseCsltWorkspaceSize bytes (at least one).
static ffi::Error MatmulImpl(cudaStream_t stream, ffi::AnyBuffer compressed, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  auto x_dims = x.dimensions();
  auto out_dims = out->dimensions();
  int dtype = dtype_code(x.element_type());
  if (x_dims.size() != 2 || out_dims.size() != 2 || dtype < 0 || out->element_type() != x.element_type() ||
      out_dims[0] != x_dims[0]) {
    return ffi::Error::InvalidArgument("cslt_matmul: x [N, K] and out [N, M] of one float16 / bfloat16 dtype");
  }
  int64_t n = x_dims[0], k = x_dims[1], m = out_dims[1];
  if (n == 0 || m == 0) return ffi::Error::Success();
  cusparseLtHandle_t* handle = nullptr;
  Plan* plan = nullptr;
  cusparseStatus_t status = plan_for(m, n, k, dtype, &handle, &plan);
  if (status != CUSPARSE_STATUS_SUCCESS) return failed("cslt_matmul: the plan", status);
  if (workspace->size_bytes() < plan->workspace) {
    return ffi::Error::InvalidArgument("cslt_matmul: workspace smaller than the plan needs");
  }
  float alpha = 1.0f, beta = 0.0f;
  status = cusparseLtMatmul(handle, &plan->plan, &alpha, compressed.untyped_data(), x.untyped_data(), &beta,
                            out->untyped_data(), out->untyped_data(),
                            plan->workspace ? workspace->untyped_data() : nullptr, &stream, 1);
  if (status != CUSPARSE_STATUS_SUCCESS) return failed("cslt_matmul: cusparseLtMatmul", status);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CsltMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // compressed weight
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()); // workspace

// hf_zero::aio_pwrite / hf_zero::aio_pread: block-parallel file I/O for NVMe offload.
//
// One call moves a whole contiguous CPU tensor to or from a byte range of a file. The range is cut into
// `block_size`-byte requests; `thread_count * queue_depth` worker threads (capped by the number of requests) each
// take the next request from a shared counter and issue a blocking pread/pwrite for it, so that many requests are
// in flight at once and the drive's queue stays full. This is the portable equivalent of DeepSpeed's libaio
// handle (`intra_op_parallelism` threads, each with `queue_depth` requests outstanding) with nothing for users to
// install: only POSIX pread/pwrite.
//
// The calls are synchronous; hf_zero/offload/swapper.py makes them asynchronous by running them on a background
// Python thread, which is why the kernels release the GIL while the I/O runs.

#include <Python.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/library.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hf_zero {
namespace {

// Releases the GIL for the lifetime of the object when the calling thread holds it (a call from Python through
// torch.ops); a no-op when called from C++ without the GIL.
class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

class Fd {
 public:
  Fd(const std::string& path, int flags) : fd_(::open(path.c_str(), flags | O_CLOEXEC, 0644)) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Moves [0, nbytes) of `data` to/from [file_offset, file_offset + nbytes) of `fd`. Returns "" or an error text.
std::string transfer(int fd, char* data, int64_t nbytes, int64_t file_offset, int64_t block_size,
                     int64_t workers_wanted, bool write) {
  const int64_t nblocks = (nbytes + block_size - 1) / block_size;
  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
  std::string error;
  auto worker = [&]() {
    for (int64_t b = next.fetch_add(1); b < nblocks; b = next.fetch_add(1)) {
      int64_t done = 0;
      const int64_t begin = b * block_size;
      const int64_t len = std::min(block_size, nbytes - begin);
      while (done < len) {
        const ssize_t n = write ? ::pwrite(fd, data + begin + done, len - done, file_offset + begin + done)
                                : ::pread(fd, data + begin + done, len - done, file_offset + begin + done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (error.empty()) {
            error = n == 0 ? std::string("unexpected end of file at byte ") + std::to_string(file_offset + begin + done)
                           : std::string(std::strerror(errno)) + " at byte " + std::to_string(file_offset + begin + done);
          }
          next.store(nblocks);  // stop the other workers early
          return;
        }
        done += n;
      }
    }
  };
  const int64_t nworkers = std::max<int64_t>(1, std::min(workers_wanted, nblocks));
  if (nworkers == 1) {
    worker();
  } else {
    std::vector<std::thread> threads;
    threads.reserve(nworkers);
    for (int64_t i = 0; i < nworkers; ++i) threads.emplace_back(worker);
    for (auto& t : threads) t.join();
  }
  return error;
}

void check_args(const at::Tensor& buffer, int64_t file_offset, int64_t block_size, int64_t queue_depth,
                int64_t thread_count, const char* op) {
  TORCH_CHECK(buffer.device().is_cpu(), op, ": buffer must be a CPU tensor, got ", buffer.device());
  TORCH_CHECK(buffer.is_contiguous(), op, ": buffer must be contiguous");
  TORCH_CHECK(file_offset >= 0, op, ": file_offset must be >= 0, got ", file_offset);
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK(queue_depth >= 1, op, ": queue_depth must be >= 1, got ", queue_depth);
  TORCH_CHECK(thread_count >= 1, op, ": thread_count must be >= 1, got ", thread_count);
}

int64_t aio_pwrite_cpu(const at::Tensor& buffer, c10::string_view path, int64_t file_offset, int64_t block_size,
                       int64_t queue_depth, int64_t thread_count) {
  check_args(buffer, file_offset, block_size, queue_depth, thread_count, "aio_pwrite");
  const std::string file(path.data(), path.size());
  const int64_t nbytes = static_cast<int64_t>(buffer.nbytes());
  char* data = static_cast<char*>(const_cast<void*>(buffer.const_data_ptr()));
  std::string error;
  {
    GilRelease no_gil;
    Fd fd(file, O_WRONLY | O_CREAT);
    if (fd.get() < 0) {
      error = std::string("cannot open for writing: ") + std::strerror(errno);
    } else {
      error = transfer(fd.get(), data, nbytes, file_offset, block_size, queue_depth * thread_count, true);
    }
  }
  TORCH_CHECK(error.empty(), "aio_pwrite: ", file, ": ", error, " (writing ", nbytes, " bytes at offset ",
              file_offset, ")");
  return nbytes;
}

int64_t aio_pread_cpu(const at::Tensor& buffer, c10::string_view path, int64_t file_offset, int64_t block_size,
                      int64_t queue_depth, int64_t thread_count) {
  check_args(buffer, file_offset, block_size, queue_depth, thread_count, "aio_pread");
  const std::string file(path.data(), path.size());
  const int64_t nbytes = static_cast<int64_t>(buffer.nbytes());
  char* data = static_cast<char*>(buffer.mutable_data_ptr());
  std::string error;
  {
    GilRelease no_gil;
    Fd fd(file, O_RDONLY);
    if (fd.get() < 0) {
      error = std::string("cannot open for reading: ") + std::strerror(errno);
    } else {
      error = transfer(fd.get(), data, nbytes, file_offset, block_size, queue_depth * thread_count, false);
    }
  }
  TORCH_CHECK(error.empty(), "aio_pread: ", file, ": ", error, " (reading ", nbytes, " bytes at offset ",
              file_offset, ")");
  return nbytes;
}

}  // namespace

// The schemas live here rather than in ops.cpp (a fragment of the same `hf_zero` library): the aio family is
// self-contained. Both return the number of bytes moved.
TORCH_LIBRARY_FRAGMENT(hf_zero, m) {
  m.def("aio_pwrite(Tensor buffer, str path, int file_offset, int block_size, int queue_depth, int thread_count) "
        "-> int");
  m.def("aio_pread(Tensor(a!) buffer, str path, int file_offset, int block_size, int queue_depth, "
        "int thread_count) -> int");
}

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("aio_pwrite", &aio_pwrite_cpu);
  m.impl("aio_pread", &aio_pread_cpu);
}

}  // namespace hf_zero

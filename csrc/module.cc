// cgx2._C: the codec's CPU loops, the shared-memory transport's primitives and NCCL
// point-to-point transfers, for Python (cgx2/extension.py loads it; cgx2/codecs/native.py,
// cgx2/comm/shm.py and cgx2/comm/nccl.py use it).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <system_error>

#include "maxmin_codec.h"
#include "rotation.h"
#include "nccl.h"
#include "shm.h"

namespace py = pybind11;

namespace {

template <typename T>
T *at(uintptr_t address) {
  return reinterpret_cast<T *>(address);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cgx2's compiled parts: the max-min codec's CPU loops and shared-memory transport";
  m.attr("ABI_VERSION") = 2;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error &e) {
      py::object error = py::module_::import("builtins").attr("OSError")(e.code().value(),
                                                                           e.what());
      PyErr_SetObject(PyExc_OSError, error.ptr());
    }
  });

  // The codec: addresses of contiguous CPU tensors' data; the GIL is released, so that ranges
  // of buckets run in threads.
  m.def(
      "maxmin_encode",
      [](uintptr_t rows, int64_t q_begin, int64_t q_end, int64_t bucket, int bits, uint64_t key,
         uint64_t stream, int64_t covered, uintptr_t meta, uintptr_t levels,
         int64_t levels_nbytes, bool saturate, float clip, bool nearest) {
        return cgx2::maxmin_encode(at<const float>(rows), q_begin, q_end, bucket, bits, key,
                                   stream, covered, at<uint8_t>(meta), at<uint8_t>(levels),
                                   levels_nbytes, saturate ? 1 : 0, clip, nearest ? 1 : 0);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "maxmin_decode",
      [](uintptr_t meta, uintptr_t levels, int64_t levels_nbytes, int64_t q_begin, int64_t q_end,
         int64_t bucket, int bits, int64_t covered, uintptr_t base, uintptr_t out, bool bf16,
         float factor) {
        cgx2::maxmin_decode(at<const float>(meta), at<const uint8_t>(levels), levels_nbytes,
                            q_begin, q_end, bucket, bits, covered,
                            base == 0 ? nullptr : at<const float>(base), at<void>(out),
                            bf16 ? 1 : 0, factor);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "hadamard_rotate",
      [](uintptr_t src, uintptr_t dst, int64_t b_begin, int64_t b_end, int64_t n, int64_t block,
         uint64_t key, float scale, bool inverse) {
        cgx2::hadamard_rotate(at<const float>(src), at<float>(dst), b_begin, b_end, n, block,
                              key, scale, inverse ? 1 : 0);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("maxmin_simd", &cgx2::maxmin_simd, py::arg("enable") = -1,
        "Whether the codec's vector loops (AVX2) run; 0 or 1 turns them off or back on where "
        "the CPU has them. The bytes are the same either way.");

  py::class_<cgx2::Segment>(m, "Segment", "A shared-memory segment (a memfd) mapped here.")
      .def_static("create", &cgx2::Segment::create, py::arg("nbytes"),
                  py::return_value_policy::take_ownership)
      .def_static("open", &cgx2::Segment::open, py::arg("pid"), py::arg("fd"), py::arg("nbytes"),
                  py::arg("inode"), py::return_value_policy::take_ownership)
      .def("release", &cgx2::Segment::release)
      .def_property_readonly("fd", &cgx2::Segment::fd)
      .def_property_readonly("inode", &cgx2::Segment::inode)
      .def_property_readonly("address", &cgx2::Segment::address)
      .def_property_readonly("nbytes", &cgx2::Segment::nbytes)
      .def(
          "memoryview",
          [](cgx2::Segment &s) {
            return py::memoryview::from_memory(at<void>(s.address()),
                                               static_cast<py::ssize_t>(s.nbytes()), false);
          },
          py::keep_alive<0, 1>());

  m.def("signal_flag", &cgx2::signal_flag, py::arg("address"), py::arg("value"));
  m.def("load_flag", &cgx2::load_flag, py::arg("address"));
  m.def("wait_flags", &cgx2::wait_flags, py::arg("addresses"), py::arg("target"),
        py::arg("timeout_s"), py::arg("pids"), py::arg("starts"),
        py::call_guard<py::gil_scoped_release>());
  m.def("process_start_time", &cgx2::process_start_time, py::arg("pid"));
  m.def("process_alive", &cgx2::process_alive, py::arg("pid"), py::arg("start"));

  m.def("nccl_available", []() {
    std::string why;
    bool ok = cgx2::nccl_available(&why);
    return std::make_pair(ok, why);
  });
  m.def("nccl_version", &cgx2::nccl_version);
  m.def("nccl_transfers", &cgx2::nccl_transfers, py::arg("comm"), py::arg("stream"),
        py::arg("send_addresses"), py::arg("send_bytes"), py::arg("send_peers"),
        py::arg("recv_addresses"), py::arg("recv_bytes"), py::arg("recv_peers"),
        py::call_guard<py::gil_scoped_release>());
  m.def("nccl_has_all_gather", &cgx2::nccl_has_all_gather);
  m.def("nccl_all_gather", &cgx2::nccl_all_gather, py::arg("comm"), py::arg("stream"),
        py::arg("send"), py::arg("recv"), py::arg("bytes"),
        py::call_guard<py::gil_scoped_release>());
}

// Fixed infrastructure: every kernels/*_binding.cpp registers its Python functions here.
//
//   static void register_relu(pybind11::module& m) { m.def("relu_forward", &relu_forward); }
//   REGISTER_BINDING(relu, register_relu);
//
// torch/csrc/utils/pybind.h brings pybind11 and the at::Tensor <-> torch.Tensor casters at a
// fraction of the compile time of torch/extension.h. The allocation ops every binding uses
// (at::empty, empty_like, empty_strided, zeros, zeros_like) come with it, and on the CUDA backend
// the current stream, the device guard and C10_CUDA_CHECK: the judge compiles this header once per
// toolchain (precompiled), so what it includes costs a binding nothing. Include other per-op ATen
// headers (ATen/ops/NAME.h) where you need them.
//
// The judge first compiles each source with CUDA_AGENT_THIN_BINDING defined: pybind11 is then a
// small stand-in whose module::def takes a function (or a captureless lambda) and an optional
// docstring, with tensors, optional tensors, lists of tensors or ints, int, float, bool and dtypes
// in and tensors, tuples or lists of tensors, numbers, bool or nothing out. The shared
// infrastructure binds those functions with pybind11's own casters, so they behave as pybind11's
// would, and the binding compiles in a fraction of the time (no pybind11 templates in it). A
// source that uses anything else of pybind11 fails that compile and is compiled again, silently,
// against the real header: write bindings the usual way. The thin compile also reads a copy of
// ATen/DeviceGuard.h without device_of(ITensorListRef) (sandbox/build/thin_shadow.py): a source that
// calls it takes the second compile too.
#pragma once

#ifndef CUDA_AGENT_THIN_BINDING
#include <torch/csrc/utils/pybind.h>
#else
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#endif

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#ifdef CUDA_AGENT_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace cuda_agent::thin {

// what a thin binding's function takes and returns; the infrastructure loads and casts each with
// pybind11's caster of exactly that C++ type (binding.cpp)
enum class Kind : unsigned char {
  Void, Tensor, OptionalTensor, TensorList, TensorTuple, IntList, IntArrayRef, ScalarType,
  Double, Float, Int64, Int32, Bool
};

using AnyFn = void (*)();
// calls `fn` with the arguments the infrastructure loaded (each the storage type of its Kind) and
// stores its result in `out` (the storage type of the result's Kind)
using Thunk = void (*)(AnyFn fn, void* const* args, void* out);

struct Def {
  const char* name;
  const char* doc;
  AnyFn fn;
  Thunk thunk;
  Kind result;
  const Kind* args;
  std::size_t nargs;
};

// a type a thin binding may take: its Kind and the type the infrastructure loads it into
template <class T> struct arg_type;  // no definition: another type fails the thin compile
template <> struct arg_type<at::Tensor> { static constexpr Kind kind = Kind::Tensor; using storage = at::Tensor; };
template <> struct arg_type<std::optional<at::Tensor>> {
  static constexpr Kind kind = Kind::OptionalTensor; using storage = std::optional<at::Tensor>; };
template <> struct arg_type<std::vector<at::Tensor>> {
  static constexpr Kind kind = Kind::TensorList; using storage = std::vector<at::Tensor>; };
template <> struct arg_type<std::vector<int64_t>> {
  static constexpr Kind kind = Kind::IntList; using storage = std::vector<int64_t>; };
// loaded by torch's IntArrayRef caster into a vector that outlives the call
template <> struct arg_type<at::IntArrayRef> {
  static constexpr Kind kind = Kind::IntArrayRef; using storage = std::vector<int64_t>; };
template <> struct arg_type<at::ScalarType> { static constexpr Kind kind = Kind::ScalarType; using storage = at::ScalarType; };
template <> struct arg_type<double> { static constexpr Kind kind = Kind::Double; using storage = double; };
template <> struct arg_type<float> { static constexpr Kind kind = Kind::Float; using storage = float; };
template <> struct arg_type<int64_t> { static constexpr Kind kind = Kind::Int64; using storage = int64_t; };
template <> struct arg_type<int32_t> { static constexpr Kind kind = Kind::Int32; using storage = int32_t; };
template <> struct arg_type<bool> { static constexpr Kind kind = Kind::Bool; using storage = bool; };

template <class A>
decltype(auto) load_arg(void* p) {
  using D = std::remove_cvref_t<A>;
  using S = typename arg_type<D>::storage;
  if constexpr (std::is_same_v<D, at::IntArrayRef>) {
    return at::IntArrayRef(*static_cast<S*>(p));
  } else if constexpr (std::is_lvalue_reference_v<A> && !std::is_const_v<std::remove_reference_t<A>>) {
    return static_cast<D&>(*static_cast<S*>(p));
  } else {
    return static_cast<D&&>(*static_cast<S*>(p));
  }
}

// a type a thin binding may return, and how it is stored for the infrastructure
template <class T> struct result_type;
template <> struct result_type<void> { static constexpr Kind kind = Kind::Void; };
template <> struct result_type<at::Tensor> {
  static constexpr Kind kind = Kind::Tensor;
  static void store(void* out, at::Tensor v) { *static_cast<at::Tensor*>(out) = std::move(v); }
};
template <> struct result_type<std::vector<at::Tensor>> {
  static constexpr Kind kind = Kind::TensorList;
  static void store(void* out, std::vector<at::Tensor> v) { *static_cast<std::vector<at::Tensor>*>(out) = std::move(v); }
};
template <class... T> struct result_type<std::tuple<T...>> {
  static_assert((std::is_same_v<std::remove_cvref_t<T>, at::Tensor> && ...), "thin bindings return tuples of tensors");
  static constexpr Kind kind = Kind::TensorTuple;
  static void store(void* out, std::tuple<T...> v) {
    auto& dst = *static_cast<std::vector<at::Tensor>*>(out);
    std::apply([&](auto&&... t) { (dst.push_back(std::forward<decltype(t)>(t)), ...); }, std::move(v));
  }
};
template <class T> struct scalar_result {
  static void store(void* out, T v) { *static_cast<T*>(out) = v; }
};
template <> struct result_type<double> : scalar_result<double> { static constexpr Kind kind = Kind::Double; };
template <> struct result_type<int64_t> : scalar_result<int64_t> { static constexpr Kind kind = Kind::Int64; };
template <> struct result_type<bool> : scalar_result<bool> { static constexpr Kind kind = Kind::Bool; };

template <class R, class... A, std::size_t... I>
void call(R (*f)(A...), void* const* args, void* out, std::index_sequence<I...>) {
  if constexpr (std::is_void_v<R>) {
    f(load_arg<A>(args[I])...);
  } else {
    result_type<std::remove_cvref_t<R>>::store(out, f(load_arg<A>(args[I])...));
  }
}

template <class R, class... A>
void thunk(AnyFn fn, void* const* args, void* out) {
  call(reinterpret_cast<R (*)(A...)>(fn), args, out, std::index_sequence_for<A...>{});
}

template <class... A>
struct arg_kinds {
  static constexpr std::array<Kind, sizeof...(A) + 1> value{arg_type<std::remove_cvref_t<A>>::kind..., Kind::Void};
};

namespace api {

// what `pybind11::module` names in a thin compile. No line of it starts with the word `module`: nvcc's C++20
// front end reads such a line as a module declaration, and a .cu that includes this header failed to compile
class module {
 public:
  template <class R, class... A>
  auto def(const char* name, R (*f)(A...), const char* doc = nullptr) -> module& {
    defs.push_back(Def{name, doc, reinterpret_cast<AnyFn>(f), &thunk<R, A...>, result_type<std::remove_cvref_t<R>>::kind,
                       arg_kinds<A...>::value.data(), sizeof...(A)});
    return *this;
  }
  template <class R, class... A>
  auto def(const char* name, R (*f)(A...) noexcept, const char* doc = nullptr) -> module& {
    return def(name, static_cast<R (*)(A...)>(f), doc);
  }
  // a captureless lambda, as its function pointer
  template <class F, class = decltype(+std::declval<F>())>
  auto def(const char* name, F f, const char* doc = nullptr) -> module& {
    return def(name, +f, doc);
  }

  std::vector<Def> defs;
};
using module_ = module;

}  // namespace api
}  // namespace cuda_agent::thin

namespace cuda_agent {

#ifndef CUDA_AGENT_THIN_BINDING
using RegisterFn = void (*)(pybind11::module&);

struct Registration {
  const char* name;
  RegisterFn fn;
};

inline std::vector<Registration>& registry() {
  static std::vector<Registration> entries;
  return entries;
}

struct Registrar {
  Registrar(const char* name, RegisterFn fn) { registry().push_back({name, fn}); }
};
#endif

using ThinRegisterFn = void (*)(thin::api::module&);

struct ThinRegistration {
  const char* name;
  ThinRegisterFn fn;
};

inline std::vector<ThinRegistration>& thin_registry() {
  static std::vector<ThinRegistration> entries;
  return entries;
}

struct ThinRegistrar {
  ThinRegistrar(const char* name, ThinRegisterFn fn) { thin_registry().push_back({name, fn}); }
};

}  // namespace cuda_agent

#ifdef CUDA_AGENT_THIN_BINDING
namespace pybind11 {  // declared already (c10's intrusive_ptr.h): module names the stand-in here
using module = ::cuda_agent::thin::api::module;
using module_ = ::cuda_agent::thin::api::module;
}  // namespace pybind11
namespace py = pybind11;
#define REGISTER_BINDING(name, fn) \
  static ::cuda_agent::ThinRegistrar cuda_agent_registrar_##name(#name, fn)
#else
#define REGISTER_BINDING(name, fn) \
  static ::cuda_agent::Registrar cuda_agent_registrar_##name(#name, fn)
#endif

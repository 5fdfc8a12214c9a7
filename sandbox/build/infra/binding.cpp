// Fixed infrastructure: the cuda_extension module, filled from the binding registry.
#include "binding_registry.h"

#include <algorithm>
#include <memory>
#include <string>

namespace cuda_agent::thin {
namespace {

namespace py = pybind11;

// one argument loaded for a thin binding's function: the storage of its Kind (binding_registry.h)
struct Slot {
  at::Tensor tensor;
  std::optional<at::Tensor> optional_tensor;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> ints;
  at::ScalarType dtype = at::ScalarType::Undefined;
  double f64 = 0;
  float f32 = 0;
  int64_t i64 = 0;
  int32_t i32 = 0;
  bool flag = false;
};

template <class T>
bool load_as(py::handle h, bool convert, T& out) {
  py::detail::make_caster<T> caster;
  if (!caster.load(h, convert)) return false;
  out = py::detail::cast_op<T&&>(std::move(caster));
  return true;
}

// h loaded into the slot as pybind11 loads an argument of the Kind's C++ type; where it is kept
void* load(Kind kind, py::handle h, bool convert, Slot& s) {
  switch (kind) {
    case Kind::Tensor: return load_as(h, convert, s.tensor) ? &s.tensor : nullptr;
    case Kind::OptionalTensor: return load_as(h, convert, s.optional_tensor) ? &s.optional_tensor : nullptr;
    case Kind::TensorList: return load_as(h, convert, s.tensors) ? &s.tensors : nullptr;
    case Kind::IntList: return load_as(h, convert, s.ints) ? &s.ints : nullptr;
    case Kind::IntArrayRef: {
      py::detail::make_caster<at::IntArrayRef> caster;
      if (!caster.load(h, convert)) return nullptr;
      at::IntArrayRef ref = py::detail::cast_op<at::IntArrayRef>(caster);
      s.ints.assign(ref.begin(), ref.end());
      return &s.ints;
    }
    case Kind::ScalarType: return load_as(h, convert, s.dtype) ? &s.dtype : nullptr;
    case Kind::Double: return load_as(h, convert, s.f64) ? &s.f64 : nullptr;
    case Kind::Float: return load_as(h, convert, s.f32) ? &s.f32 : nullptr;
    case Kind::Int64: return load_as(h, convert, s.i64) ? &s.i64 : nullptr;
    case Kind::Int32: return load_as(h, convert, s.i32) ? &s.i32 : nullptr;
    case Kind::Bool: return load_as(h, convert, s.flag) ? &s.flag : nullptr;
    case Kind::Void:
    case Kind::TensorTuple: break;
  }
  return nullptr;
}

py::object result_object(Kind kind, Slot& s) {
  switch (kind) {
    case Kind::Void: return py::none();
    case Kind::Tensor: return py::cast(std::move(s.tensor));
    case Kind::TensorList: return py::cast(std::move(s.tensors));
    case Kind::TensorTuple: {
      py::tuple out(s.tensors.size());
      for (std::size_t i = 0; i < s.tensors.size(); ++i) out[i] = py::cast(std::move(s.tensors[i]));
      return std::move(out);
    }
    case Kind::Double: return py::cast(s.f64);
    case Kind::Int64: return py::cast(s.i64);
    case Kind::Bool: return py::cast(s.flag);
    default: break;
  }
  throw std::logic_error("cuda-agent: a thin binding returned a type the infrastructure does not cast");
}

void* result_slot(Kind kind, Slot& s) {
  switch (kind) {
    case Kind::Tensor: return &s.tensor;
    case Kind::TensorList:
    case Kind::TensorTuple: return &s.tensors;
    case Kind::Double: return &s.f64;
    case Kind::Int64: return &s.i64;
    case Kind::Bool: return &s.flag;
    default: return nullptr;
  }
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::Void: return "None";
    case Kind::Tensor: return "torch.Tensor";
    case Kind::OptionalTensor: return "torch.Tensor | None";
    case Kind::TensorList: return "list[torch.Tensor]";
    case Kind::TensorTuple: return "tuple[torch.Tensor, ...]";
    case Kind::IntList:
    case Kind::IntArrayRef: return "list[int]";
    case Kind::ScalarType: return "torch.dtype";
    case Kind::Double:
    case Kind::Float: return "float";
    case Kind::Int64:
    case Kind::Int32: return "int";
    case Kind::Bool: return "bool";
  }
  return "object";
}

std::string signature(const Def& d) {
  std::string out = "(";
  for (std::size_t i = 0; i < d.nargs; ++i) {
    out += (i ? ", arg" : "arg") + std::to_string(i) + ": " + kind_name(d.args[i]);
  }
  return out + ") -> " + kind_name(d.result);
}

// One Python function for every thin def of a name, resolved as pybind11 resolves overloads: positional
// arguments only (no py::arg in a thin binding), a pass without implicit conversions first where there are
// several, then one with them.
py::object dispatch(const std::vector<Def>& defs, py::args args, py::kwargs kwargs) {
  const std::size_t n = args.size();
  const bool overloaded = defs.size() > 1;
  if (kwargs.empty()) {
    std::vector<Slot> slots(n);
    std::vector<void*> ptrs(n);
    for (int pass = overloaded ? 0 : 1; pass < 2; ++pass) {
      for (const Def& d : defs) {
        if (d.nargs != n) continue;
        std::size_t i = 0;
        for (; i < n; ++i) {
          slots[i] = Slot();
          if (!(ptrs[i] = load(d.args[i], args[i], pass == 1, slots[i]))) break;
        }
        if (i < n) continue;
        Slot result;
        d.thunk(d.fn, ptrs.data(), result_slot(d.result, result));
        return result_object(d.result, result);
      }
    }
  }
  std::string msg = std::string(defs.front().name) +
                    "(): incompatible function arguments. The following argument types are supported:\n";
  for (std::size_t i = 0; i < defs.size(); ++i) {
    msg += "    " + std::to_string(i + 1) + ". " + signature(defs[i]) + "\n";
  }
  msg += "\nInvoked with: ";
  for (std::size_t i = 0; i < n; ++i) msg += (i ? ", " : "") + py::repr(args[i]).cast<std::string>();
  if (!kwargs.empty()) msg += std::string(n ? ", " : "") + "kwargs: " + py::repr(kwargs).cast<std::string>();
  throw py::type_error(msg);
}

void bind_thin(py::module_& m) {
  // every def of a thin registration, grouped by name in the order of their first def
  std::vector<std::pair<std::string, std::vector<Def>>> named;
  for (const auto& entry : thin_registry()) {
    api::module collected;
    entry.fn(collected);
    for (const Def& d : collected.defs) {
      auto at = std::find_if(named.begin(), named.end(), [&](const auto& p) { return p.first == d.name; });
      if (at == named.end()) {
        named.emplace_back(d.name, std::vector<Def>{d});
      } else {
        at->second.push_back(d);
      }
    }
  }
  py::options options;
  options.disable_function_signatures();  // the docstring below says each signature as pybind11 would
  for (auto& [name, defs] : named) {
    std::string doc;
    for (const Def& d : defs) {
      doc += name + signature(d) + "\n";
      if (d.doc && *d.doc) doc += std::string("\n") + d.doc + "\n";
    }
    auto keep = std::make_shared<const std::vector<Def>>(std::move(defs));
    m.def(name.c_str(), [keep](py::args args, py::kwargs kwargs) { return dispatch(*keep, std::move(args), std::move(kwargs)); },
          py::doc(doc.c_str()));
  }
}

}  // namespace
}  // namespace cuda_agent::thin

PYBIND11_MODULE(cuda_extension, m) {
  m.doc() = "kernels built by the cuda-agent sandbox";
  for (const auto& entry : cuda_agent::registry()) {
    entry.fn(m);
  }
  cuda_agent::thin::bind_thin(m);
}

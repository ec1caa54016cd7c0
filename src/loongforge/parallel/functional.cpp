#include "loongforge/parallel/functional.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace lf::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const Group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<const Group*>(ctx->saved_data["group"].toInt());
}

at::Tensor part(const at::Tensor& x, const Group& g, int64_t dim) {
  TORCH_CHECK(x.size(dim) % g.size() == 0, "split: dim ", dim, " of size ", x.size(dim), " not divisible by ", g.size());
  return x.chunk(g.size(), dim)[static_cast<size_t>(g.rank())].contiguous();
}

at::Tensor a2a(const at::Tensor& x, const Group& g, int64_t scatter_dim, int64_t gather_dim) {
  if (g.size() == 1) return x;
  const int64_t n = g.size();
  TORCH_CHECK(x.size(scatter_dim) % n == 0, "all_to_all: dim ", scatter_dim, " of size ", x.size(scatter_dim),
              " not divisible by ", n);
  at::Tensor send = at::stack(x.chunk(n, scatter_dim), 0).contiguous();  // [n, chunk...]: row j goes to rank j
  at::Tensor recv = g.all_to_all(send);                                  // row i came from rank i
  return at::cat(recv.unbind(0), gather_dim);
}

struct CopyTo : torch::autograd::Function<CopyTo> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g) {
    ctx->saved_data["group"] = g;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor gr = grads[0].contiguous().clone();
    group_of(ctx).all_reduce(gr);
    return {gr, at::Tensor()};
  }
};

struct ReduceFrom : torch::autograd::Function<ReduceFrom> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g) {
    at::Tensor y = x.contiguous().clone();
    reinterpret_cast<const Group*>(g)->all_reduce(y);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct Split : torch::autograd::Function<Split> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, int64_t dim) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    return part(x, *reinterpret_cast<const Group*>(g), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx).all_gather(grads[0], ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct Gather : torch::autograd::Function<Gather> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, int64_t dim) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    return reinterpret_cast<const Group*>(g)->all_gather(x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {part(grads[0], group_of(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct GatherRS : torch::autograd::Function<GatherRS> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, int64_t dim) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    return reinterpret_cast<const Group*>(g)->all_gather(x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx).reduce_scatter(grads[0], ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatter : torch::autograd::Function<ReduceScatter> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, int64_t dim) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    return reinterpret_cast<const Group*>(g)->reduce_scatter(x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx).all_gather(grads[0], ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, int64_t sdim, int64_t gdim) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["s"] = sdim;
    ctx->saved_data["g"] = gdim;
    return a2a(x, *reinterpret_cast<const Group*>(g), sdim, gdim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {a2a(grads[0], group_of(ctx), ctx->saved_data["g"].toInt(), ctx->saved_data["s"].toInt()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

int64_t handle(const Group& g) { return reinterpret_cast<int64_t>(&g); }
int64_t norm_dim(const at::Tensor& x, int64_t d) { return d < 0 ? d + x.dim() : d; }

}  // namespace

at::Tensor copy_to(const at::Tensor& x, const Group& g) { return g.size() == 1 ? x : CopyTo::apply(x, handle(g)); }
at::Tensor reduce_from(const at::Tensor& x, const Group& g) { return g.size() == 1 ? x : ReduceFrom::apply(x, handle(g)); }
at::Tensor split(const at::Tensor& x, const Group& g, int64_t dim) {
  return g.size() == 1 ? x : Split::apply(x, handle(g), norm_dim(x, dim));
}
at::Tensor gather(const at::Tensor& x, const Group& g, int64_t dim) {
  return g.size() == 1 ? x : Gather::apply(x, handle(g), norm_dim(x, dim));
}
at::Tensor gather_rs(const at::Tensor& x, const Group& g, int64_t dim) {
  return g.size() == 1 ? x : GatherRS::apply(x, handle(g), norm_dim(x, dim));
}
at::Tensor reduce_scatter(const at::Tensor& x, const Group& g, int64_t dim) {
  return g.size() == 1 ? x : ReduceScatter::apply(x, handle(g), norm_dim(x, dim));
}
at::Tensor all_to_all(const at::Tensor& x, const Group& g, int64_t scatter_dim, int64_t gather_dim) {
  return g.size() == 1 ? x : AllToAll::apply(x, handle(g), norm_dim(x, scatter_dim), norm_dim(x, gather_dim));
}

}  // namespace lf::parallel

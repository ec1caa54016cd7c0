// Progress on the terminal (a bar with ETA on a TTY, lines otherwise) and the peak FLOP rate MFU is measured against.
#pragma once
#include <ATen/core/Tensor.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace lf::train {

// peak_tflops (log.peak_tflops) when > 0, else the device's dense bf16 peak (H100/H200) or the CPU's AVX2 FMA rate x threads.
double peak_flops(double peak_tflops, const at::Device& device);

class Progress {
 public:
  Progress(const std::string& mode, int64_t total) : total_(total) {
    bar_ = mode == "bar" || (mode == "auto" && ::isatty(STDOUT_FILENO));
    off_ = mode == "off";
  }
  void update(int64_t step, double loss, double lr, double tps, double eta_s, bool line) {
    if (off_) return;
    if (bar_) {
      int width = 30, filled = static_cast<int>(width * step / std::max<int64_t>(1, total_));
      std::string bar(filled, '#');
      bar.resize(width, '.');
      std::printf("\r[%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s ETA %s   ", bar.c_str(), (long long)step,
                  (long long)total_, loss, lr, tps, fmt_eta(eta_s).c_str());
      std::fflush(stdout);
    } else if (line) {
      std::printf("step %lld/%lld loss %.4f lr %.3e tok/s %.0f eta %s\n", (long long)step, (long long)total_, loss, lr, tps,
                  fmt_eta(eta_s).c_str());
      std::fflush(stdout);
    }
  }
  void note(const std::string& s) {
    if (off_) return;
    std::printf("%s%s\n", bar_ ? "\n" : "", s.c_str());
    std::fflush(stdout);
  }
  void done() {
    if (bar_ && !off_) std::printf("\n");
  }

 private:
  static std::string fmt_eta(double s) {
    char buf[32];
    int t = static_cast<int>(s);
    std::snprintf(buf, sizeof buf, "%d:%02d", t / 60, t % 60);
    return buf;
  }
  int64_t total_;
  bool bar_ = false, off_ = false;
};

}  // namespace lf::train

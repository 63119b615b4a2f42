#include "arena_cache.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "model.h"
#ifdef __linux__
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace zen5 {

namespace {
// Bump whenever pack_into / pack_float_panels / owned_bytes change the arena's bytes or layout,
// or pack_and_hash the fingerprint's definition (the trailer's fingerprint stands for a fresh
// load's): a file of another layout is then ignored (and rewritten), never misread. 2: a matrix
// is fingerprinted by its 16-row groups' hashes.
constexpr uint64_t kLayout = 2;
constexpr char kMagic[8] = {'Z', 'E', 'N', '5', 'A', 'R', 'N', '1'};

struct Trailer {
    char magic[8];
    uint64_t layout, bytes, key, seed, fingerprint, reserved, check;
};
static_assert(sizeof(Trailer) == 64, "the trailer is 64 bytes");

uint64_t trailer_check(const Trailer& t) { return hash_bytes(&t, offsetof(Trailer, check), 0x41524E41); }

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }
}  // namespace

bool transparent_huge_pages() {
#ifdef __linux__
    static const bool on = [] {
        char buf[128] = {};
        FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
        if (!f) return false;
        const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
        std::fclose(f);
        return n > 0 && !std::strstr(buf, "[never]");
    }();
    return on;
#else
    return false;
#endif
}

ArenaCache::~ArenaCache() {
    finish();
    stop_ = true;
    if (promoter_.joinable()) promoter_.join();
}

std::string ArenaCache::status() const {
    std::lock_guard<std::mutex> lock(status_mu_);
    return status_;
}

void ArenaCache::set_status(std::string s) {
    std::lock_guard<std::mutex> lock(status_mu_);
    status_ = std::move(s);
}

void ArenaCache::finish() {
    std::lock_guard<std::mutex> lock(finish_mu_);
    if (writer_.joinable()) writer_.join();
}

bool ArenaCache::map(uint8_t* arena, size_t reserved, size_t bytes, uint64_t seed, uint64_t& fingerprint) {
#ifdef __linux__
    if (path_.empty() || reserved < bytes) return false;
    const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT) miss_ = errno_text("cannot open");
        return false;
    }
    struct stat st;
    Trailer t;
    const bool ok = fstat(fd, &st) == 0 && size_t(st.st_size) == bytes + sizeof t &&
                    pread(fd, &t, sizeof t, off_t(bytes)) == ssize_t(sizeof t);
    if (!ok) miss_ = "its size is not this model's arena plus the trailer";
    else if (std::memcmp(t.magic, kMagic, 8) || t.check != trailer_check(t)) miss_ = "its trailer is corrupt";
    else if (t.layout != kLayout) miss_ = "it has another arena layout (written by another zen5 version)";
    else if (t.bytes != bytes || t.key != key_ || t.seed != seed) miss_ = "it was written for another model";
    if (!miss_.empty()) {
        close(fd);
        return false;
    }
    // MAP_POPULATE: every page mapped in one call (the file is in the page cache after the first
    // load, so this is page-table work, not reading), instead of a fault per 4 KiB page in decode
    void* p = mmap(arena, bytes, PROT_READ, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0);
    close(fd);  // the mapping keeps the file open
    if (p == MAP_FAILED) {
        // MAP_FIXED failed before replacing anything; the arena is still the zeroed anonymous one
        miss_ = errno_text("cannot map it");
        return false;
    }
    fingerprint = t.fingerprint;
    set_status("hit");
    start_promotion(arena, reserved, bytes);
    return true;
#else
    (void)arena, (void)reserved, (void)bytes, (void)seed, (void)fingerprint;
    return false;
#endif
}

void ArenaCache::start_promotion(uint8_t* arena, size_t reserved, size_t bytes) {
#ifdef __linux__
    if (reserved < bytes || promoter_.joinable()) return;  // heap memory (a tiny arena): left as it is
    done_ = false;
    promoter_ = std::thread([this, arena, bytes] { promote(arena, bytes); });
#else
    (void)arena, (void)reserved, (void)bytes;
#endif
}

void ArenaCache::promote(uint8_t* arena, size_t bytes) {
#ifdef __linux__
    // low priority: decoding, which runs meanwhile from the mapped file, comes first
    setpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)), 10);
    constexpr size_t kHuge = size_t(2) << 20, kChunk = size_t(8) << 20;
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    for (size_t off = 0; off < bytes && !stop_; off += kChunk) {
        // the last chunk rounded up to a page: mremap moves whole pages (the arena's own mapping
        // extends to a 2 MiB boundary, alloc_zeroed, so the rounded range is still the arena's)
        const size_t len = (std::min(kChunk, bytes - off) + page - 1) / page * page;
        void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) break;  // out of memory: the rest stays mapped from the file
        const uintptr_t s = reinterpret_cast<uintptr_t>(raw), a = (s + kHuge - 1) / kHuge * kHuge;
        if (a > s) munmap(raw, a - s);
        if (s + kHuge > a) munmap(reinterpret_cast<void*>(a + len), s + kHuge - a);
        uint8_t* tmp = reinterpret_cast<uint8_t*>(a);
        madvise(tmp, len, MADV_HUGEPAGE);
        std::memcpy(tmp, arena + off, len);
        mprotect(tmp, len, PROT_READ);
        if (mremap(tmp, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, arena + off) == MAP_FAILED) {
            munmap(tmp, len);
            break;
        }
    }
#else
    (void)arena, (void)bytes;
#endif
    done_ = true;
}

void ArenaCache::write(const uint8_t* arena, size_t bytes, uint64_t seed, uint64_t fingerprint) {
#ifdef __linux__
    if (path_.empty()) return;
    if (!write_) {
        set_status("not written: too little free disk space");
        return;
    }
    set_status("writing");
    writer_ = std::thread([this, arena, bytes, seed, fingerprint] {
        // low priority: inference, which starts meanwhile, comes first
        setpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)), 10);
        const std::string why = write_file(arena, bytes, seed, fingerprint);
        set_status(why.empty() ? "written" : "not written: " + why);
    });
#else
    (void)arena, (void)bytes, (void)seed, (void)fingerprint;
#endif
}

// The file under a temporary name, renamed when complete: no reader ever sees a partial file.
// Returns "" or why it was not written (nothing is left behind then).
std::string ArenaCache::write_file(const uint8_t* arena, size_t bytes, uint64_t seed, uint64_t fingerprint) const {
#ifdef __linux__
    Trailer t{};
    std::memcpy(t.magic, kMagic, 8);
    t.layout = kLayout, t.bytes = bytes, t.key = key_, t.seed = seed, t.fingerprint = fingerprint;
    t.check = trailer_check(t);
    const std::string tmp = path_ + ".tmp." + std::to_string(getpid());
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return errno_text("cannot create the file");
    auto put = [fd](const uint8_t* p, size_t n) {
        while (n) {
            const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) return false;
            p += w, n -= size_t(w);
        }
        return true;
    };
    bool ok = put(arena, bytes) && put(reinterpret_cast<const uint8_t*>(&t), sizeof t);
    std::string why = ok ? "" : errno_text("writing failed");
    if (close(fd) != 0 && ok) ok = false, why = errno_text("closing failed");  // e.g. ENOSPC at writeback
    if (ok && rename(tmp.c_str(), path_.c_str()) != 0) ok = false, why = errno_text("rename failed");
    if (!ok) unlink(tmp.c_str());
    return why;
#else
    (void)arena, (void)bytes, (void)seed, (void)fingerprint;
    return "not supported";
#endif
}

}  // namespace zen5

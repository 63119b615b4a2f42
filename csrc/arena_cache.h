// The weight arena kept on disk (issue 21: load time). Every matrix is repacked at load
// (model.h: pack_and_hash), which needs fresh memory for a full copy of the weights; on a VM the
// first touch of fresh anonymous memory runs at 0.6-3 s per GiB (the host backs guest memory
// lazily; huge pages cost more than 4 KiB ones, so the packing touches 4 KiB pages: model.cpp),
// several times what llama.cpp's load costs, which maps the file's page-cache pages and touches
// nothing new. So the first load writes the packed arena to a cache file, and
// later loads map that file over the arena's address range instead of packing: the same bytes at
// the same addresses, in the page cache, with no pass over the source file.
//
// A mapped file has 4 KiB pages, and decode, which streams every weight byte per token, read
// BF16 weights about 10% slower from them at 2 threads than from the huge pages of the anonymous
// arena (measured: 1.7B BF16, 7.9 vs 8.9 tok/s). So once mapped, a background thread at low
// priority copies the arena, a chunk at a time, into fresh huge-page memory and moves it over the
// file mapping with mremap: the move is atomic for readers (a concurrent access sees the old or the
// new page, with the same bytes), so decoding runs during it, from the first token on. A packed
// arena (the first load, or no cache) is on 4 KiB pages too and moves the same way.
//
// The first load writes the file from a background thread at low priority, so the first token
// does not wait for the disk: on an AMD EPYC Zen 3 VM, writing SmolLM2-1.7B's 0.92 GB Q4_0 arena
// took 2.8 s, where packing it took 0.9 (write() copies into the page cache, and past the dirty
// limit waits for writeback). The arena is immutable once packed, so inference reads it
// meanwhile; destroying the cache (the model) waits for the write to end.
//
// The file is the arena's bytes then a 64-byte trailer (magic, layout version, size, the source's
// identity key, the configuration's hash and the fingerprint, and a checksum of the trailer). It
// is written to a temporary name and renamed, so a crash or a full disk never leaves a file under
// the final name; a file whose trailer does not match in every field is ignored and rewritten.
// The bytes themselves are not checksummed (that would read the whole file at every load; the
// file is ours, written atomically, and keyed by the source's identity).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace zen5 {

// Where a model's arena is cached: path, the cache file ("" = no cache); key, the source files'
// identity (zen5/weight_cache.py); write, whether a miss may write the file (the caller checked
// the disk's free space).
struct CacheSpec {
    std::string path;
    uint64_t key = 0;
    bool write = true;
};

// Whether this system gives transparent huge pages to a region advised for them
// (/sys/kernel/mm/transparent_hugepage/enabled is not "never"); read once.
bool transparent_huge_pages();

class ArenaCache {
  public:
    explicit ArenaCache(const CacheSpec& spec = {}) : path_(spec.path), key_(spec.key), write_(spec.write) {}
    ~ArenaCache();  // ends the write and stops the promotion before the arena is unmapped
    ArenaCache(const ArenaCache&) = delete;
    ArenaCache& operator=(const ArenaCache&) = delete;

    // Maps the cached arena over [arena, arena + bytes) (MAP_FIXED) when the file matches
    // (bytes, key, seed: the configuration's hash); sets `fingerprint` and starts the promotion.
    // `reserved`: the length of the anonymous mapping at `arena` (alloc_zeroed; 0: not a mapping,
    // never mapped over).
    bool map(uint8_t* arena, size_t reserved, size_t bytes, uint64_t seed, uint64_t& fingerprint);
    // After a miss: starts writing the packed arena in the background (when the cache is on and
    // writing allowed); the arena must stay unchanged until finish() or destruction.
    void write(const uint8_t* arena, size_t bytes, uint64_t seed, uint64_t fingerprint);
    void finish();  // waits until a write started by write() has ended
    // Moves [arena, arena + bytes) onto huge pages in the background (the mapped cache, and a
    // packed arena, which is on 4 KiB pages: model.cpp); `reserved` as for map(). The arena must
    // stay unchanged from here on: the moved chunks are read-only.
    void start_promotion(uint8_t* arena, size_t reserved, size_t bytes);

    // "off" | "hit" | "writing" | "written" | "not written: <why>"; `miss`: why an existing file
    // was not used
    std::string status() const;
    const std::string& miss() const { return miss_; }
    bool promoted() const { return done_.load(); }  // true once a move started has ended (or none was)

  private:
    void promote(uint8_t* arena, size_t bytes);
    std::string write_file(const uint8_t* arena, size_t bytes, uint64_t seed, uint64_t fingerprint) const;
    void set_status(std::string s);
    std::string path_;
    uint64_t key_;
    bool write_;
    mutable std::mutex status_mu_;  // status_ changes on the writer thread
    std::mutex finish_mu_;          // one joiner at a time
    std::string status_ = "off", miss_;
    std::atomic<bool> stop_{false}, done_{true};
    std::thread promoter_, writer_;
};

}  // namespace zen5

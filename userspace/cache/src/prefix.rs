//! The prefix index: a radix tree whose edges are whole token blocks.
//!
//! A node stands for one block of `page_tokens` tokens at a given depth below its parent, and
//! holds one reference on page `depth - 1` of every global and index pool (the pages that block
//! filled). A path from the root spells a block-aligned token prefix; looking a prompt up walks
//! the path as far as its blocks match. Because a block is a whole number of pages for every
//! source, a match maps whole, full pages; full pages are immutable, so sharing them is safe.
//!
//! Children are found by a hash of the block's tokens and confirmed by comparing the tokens, so
//! a hash collision never maps the wrong pages.
//!
//! Eviction is least-recently-used over unpinned leaves. A live sequence pins the node of its
//! last published block, so the chain it extends is never evicted under it; interior nodes are
//! never evicted (a leaf goes first, then its parent may become a leaf).

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use super::pool::PageId;

/// A node of the tree; the root is [`ROOT`].
pub(crate) type NodeId = u32;

/// The root: the empty prefix. Always present, holds no pages, never evicted.
pub(crate) const ROOT: NodeId = 0;

struct Node {
    parent: NodeId,
    depth: u32,
    hash: u64,
    key: Box<[u32]>,
    pages: Box<[PageId]>,
    children: HashMap<u64, Vec<NodeId>>,
    child_count: u32,
    pins: u32,
    last_used: u64,
    /// The `last_used` under which the node sits in the evictable set.
    lru: Option<u64>,
}

pub(crate) struct PrefixIndex {
    nodes: Vec<Option<Node>>,
    vacant: Vec<NodeId>,
    evictable: BTreeSet<(u64, NodeId)>,
    tick: u64,
    blocks: usize,
}

fn block_hash(key: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

impl PrefixIndex {
    pub(crate) fn new() -> PrefixIndex {
        let root = Node {
            parent: ROOT,
            depth: 0,
            hash: 0,
            key: Box::new([]),
            pages: Box::new([]),
            children: HashMap::new(),
            child_count: 0,
            pins: 1,
            last_used: 0,
            lru: None,
        };
        PrefixIndex {
            nodes: vec![Some(root)],
            vacant: Vec::new(),
            evictable: BTreeSet::new(),
            tick: 0,
            blocks: 0,
        }
    }

    fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id as usize).and_then(Option::as_ref)
    }

    fn node_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        self.nodes.get_mut(id as usize).and_then(Option::as_mut)
    }

    /// Cached blocks (nodes other than the root).
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    pub(crate) fn depth(&self, id: NodeId) -> u32 {
        self.node(id).map_or(0, |n| n.depth)
    }

    /// The block's token ids (empty for the root).
    pub(crate) fn key(&self, id: NodeId) -> &[u32] {
        self.node(id).map_or(&[], |n| &n.key)
    }

    /// The parent (the root for the root).
    pub(crate) fn parent(&self, id: NodeId) -> NodeId {
        self.node(id).map_or(ROOT, |n| n.parent)
    }

    pub(crate) fn pages(&self, id: NodeId) -> &[PageId] {
        self.node(id).map_or(&[], |n| &n.pages)
    }

    /// The child of `parent` for block `key`.
    pub(crate) fn child(&self, parent: NodeId, key: &[u32]) -> Option<NodeId> {
        let ids = self.node(parent)?.children.get(&block_hash(key))?;
        ids.iter()
            .copied()
            .find(|&c| self.node(c).is_some_and(|n| &*n.key == key))
    }

    /// The longest path of nodes matching `tokens` block by block, at most `max_blocks` long.
    pub(crate) fn lookup(&self, tokens: &[u32], block: usize, max_blocks: usize) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut at = ROOT;
        for key in tokens.chunks_exact(block).take(max_blocks) {
            match self.child(at, key) {
                Some(c) => {
                    path.push(c);
                    at = c;
                }
                None => break,
            }
        }
        path
    }

    /// The ancestor of `id` (or `id` itself) at `depth`; the root for depth 0.
    pub(crate) fn ancestor(&self, mut id: NodeId, depth: u32) -> NodeId {
        while let Some(n) = self.node(id) {
            if n.depth <= depth {
                return id;
            }
            id = n.parent;
        }
        ROOT
    }

    fn refresh(&mut self, id: NodeId) {
        let Some(n) = self.node_mut(id) else { return };
        let eligible = id != ROOT && n.child_count == 0 && n.pins == 0;
        let old = n.lru.take();
        if eligible {
            n.lru = Some(n.last_used);
        }
        let new = n.lru;
        if let Some(t) = old {
            self.evictable.remove(&(t, id));
        }
        if let Some(t) = new {
            self.evictable.insert((t, id));
        }
    }

    /// Marks a node used now.
    pub(crate) fn touch(&mut self, id: NodeId) {
        self.tick += 1;
        let t = self.tick;
        if let Some(n) = self.node_mut(id) {
            n.last_used = t;
        }
        self.refresh(id);
    }

    pub(crate) fn pin(&mut self, id: NodeId) {
        if let Some(n) = self.node_mut(id) {
            n.pins += 1;
        }
        self.refresh(id);
    }

    pub(crate) fn unpin(&mut self, id: NodeId) {
        if let Some(n) = self.node_mut(id) {
            n.pins = n.pins.saturating_sub(1);
        }
        self.refresh(id);
    }

    /// Adds block `key` under `parent`, holding `pages` (the caller has taken a reference on
    /// each). The caller has checked that no such child exists.
    pub(crate) fn insert(&mut self, parent: NodeId, key: &[u32], pages: Box<[PageId]>) -> NodeId {
        let hash = block_hash(key);
        let depth = self.depth(parent) + 1;
        self.tick += 1;
        let node = Node {
            parent,
            depth,
            hash,
            key: key.into(),
            pages,
            children: HashMap::new(),
            child_count: 0,
            pins: 0,
            last_used: self.tick,
            lru: None,
        };
        let id = match self.vacant.pop() {
            Some(id) => {
                if let Some(slot) = self.nodes.get_mut(id as usize) {
                    *slot = Some(node);
                }
                id
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as NodeId
            }
        };
        if let Some(p) = self.node_mut(parent) {
            p.children.entry(hash).or_default().push(id);
            p.child_count += 1;
        }
        self.blocks += 1;
        self.refresh(parent);
        self.refresh(id);
        id
    }

    /// Removes the least recently used unpinned leaf and returns its pages (whose references
    /// the caller must release); `None` when nothing is evictable.
    pub(crate) fn evict_lru(&mut self) -> Option<Box<[PageId]>> {
        let (_, id) = self.evictable.pop_first()?;
        let node = self.nodes.get_mut(id as usize)?.take()?;
        self.vacant.push(id);
        self.blocks -= 1;
        if let Some(p) = self.node_mut(node.parent) {
            if let Some(ids) = p.children.get_mut(&node.hash) {
                ids.retain(|&c| c != id);
                if ids.is_empty() {
                    p.children.remove(&node.hash);
                }
            }
            p.child_count = p.child_count.saturating_sub(1);
        }
        self.refresh(node.parent);
        Some(node.pages)
    }

    /// Every cached block's pages, for accounting.
    pub(crate) fn all_pages(&self) -> impl Iterator<Item = &[PageId]> {
        self.nodes.iter().flatten().map(|n| &*n.pages)
    }

    /// Heap bytes of the tree (hash-map entries estimated at key + value + 8 bytes).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        let mut b = self.nodes.capacity() * size_of::<Option<Node>>()
            + self.vacant.capacity() * size_of::<NodeId>()
            + self.evictable.len() * (size_of::<(u64, NodeId)>() + 8);
        for n in self.nodes.iter().flatten() {
            b += n.key.len() * size_of::<u32>() + n.pages.len() * size_of::<PageId>();
            b += n.children.capacity() * (size_of::<u64>() + size_of::<Vec<NodeId>>() + 8);
            b += n
                .children
                .values()
                .map(|v| v.capacity() * size_of::<NodeId>())
                .sum::<usize>();
        }
        b as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_insert_pin_and_lru_eviction() {
        let mut t = PrefixIndex::new();
        let a = t.insert(ROOT, &[1, 2], Box::new([10]));
        let b = t.insert(a, &[3, 4], Box::new([11]));
        let c = t.insert(ROOT, &[9, 9], Box::new([12]));
        assert_eq!(t.lookup(&[1, 2, 3, 4, 5, 6], 2, usize::MAX), vec![a, b]);
        assert_eq!(t.lookup(&[1, 2, 3, 4, 5, 6], 2, 1), vec![a]);
        assert_eq!(t.lookup(&[1, 3], 2, usize::MAX), Vec::<NodeId>::new());
        assert_eq!(t.ancestor(b, 1), a);
        assert_eq!(t.ancestor(b, 0), ROOT);
        t.pin(b);
        t.touch(c);
        // b is pinned and a has a child: only c can go.
        assert_eq!(t.evict_lru().as_deref(), Some(&[12][..]));
        assert_eq!(t.evict_lru(), None);
        t.unpin(b);
        assert_eq!(t.evict_lru().as_deref(), Some(&[11][..]));
        assert_eq!(t.evict_lru().as_deref(), Some(&[10][..]));
        assert_eq!(t.blocks(), 0);
        // Slots are reused.
        let d = t.insert(ROOT, &[5, 5], Box::new([1]));
        assert!([a, b, c].contains(&d) && t.nodes.len() == 4);
    }
}
